"""The tensor-core int4 GEMV (kernels/triton/quant_gemv_mma.py) in Triton's CPU interpreter, against
x @ dequantized(w).T in float64: its plain shift-and-mask unpacking and the K order the PTX
unpacking shares with it. tests/kernels/triton/test_quant_matmul_gpu.py runs the PTX on a GPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter"
)
from nanoqwen.kernels.triton import quant_gemv_mma  # noqa: E402
from nanoqwen.kernels.triton.quant_gemv_mma import MmaGemvConfig, mma_gemv_fits  # noqa: E402
from nanoqwen.kernels.triton.quant_matmul import (  # noqa: E402
    pack_for_triton,
    quant_linear,
    quant_linear_silu_mul,
)

N = 37  # a partial block of output rows at 16 and 32 rows a program
# Tolerances: the codes reach the dots as 128 + code (the magic float they unpack into), so a
# group's float32 sum is ~100x what the codes alone give, and the correction that takes it
# back out leaves ~1e-5 of a row's sum of |x| times its scale: SiLU·up's products need 1e-4
# relative where codes summed alone would pass at 1e-5.


def make_weight(n: int, k: int, group: int, offset: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    s = (torch.rand(n, k // group, generator=gen) + 0.5) * 0.04
    o = torch.randn(n, k // group, generator=gen) * 0.1 if offset else None
    w = q.double() * s.double().repeat_interleave(group, 1)
    if o is not None:
        w += o.double().repeat_interleave(group, 1)
    return pack_for_triton(q, s, o, group, 4), w


def reference(x, w, bias=None):
    return F.linear(x.double(), w, None if bias is None else bias.double())


@pytest.fixture
def launches(monkeypatch):
    """The tensor-core GEMV's launches (their silu_mul flags), so a test knows what ran."""
    calls = []
    launch = quant_gemv_mma.launch_mma_gemv

    def recorded(x, w, bias, silu_mul, config):
        calls.append(silu_mul)
        return launch(x, w, bias, silu_mul, config)

    monkeypatch.setattr("nanoqwen.kernels.triton.quant_matmul.launch_mma_gemv", recorded)
    return calls


# (K, group): one group a panel, two panels a group, one scale per row at a K that leaves a
# partial panel, and 5 panels (a partial step at 2 and 4 panels a step).
SHAPES = [(384, 128), (512, 256), (320, 320), (640, 128)]


@pytest.mark.parametrize(("k", "group"), SHAPES)
@pytest.mark.parametrize("offset", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize(
    "config",
    [
        None,
        MmaGemvConfig(16, 1),
        MmaGemvConfig(32, 2),
        MmaGemvConfig(16, 4, num_stages=2),
        MmaGemvConfig(64, 4, num_warps=8),
        MmaGemvConfig(16, 1, splits=3),
        MmaGemvConfig(32, 2, splits=2),
        MmaGemvConfig(32, 4, max_registers=128),
    ],
    ids=[
        "default",
        "16x1",
        "32x2",
        "16x4",
        "64x4-8warps",
        "16x1-3splits",
        "32x2-2splits",
        "32x4-128regs",
    ],
)
def test_one_row_equals_the_dequantized_product(k, group, offset, config, launches):
    packed, w = make_weight(N, k, group, offset, seed=k + group)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(1, k, generator=gen)
    bias = torch.randn(N, generator=gen)
    y = quant_linear(x, packed, bias, config=config)
    assert launches == [False] and y.shape == (1, N) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), reference(x, w, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "config",
    [None, MmaGemvConfig(16, 1), MmaGemvConfig(32, 2), MmaGemvConfig(64, 4, num_warps=8)],
    ids=["default", "16x1", "32x2", "64x4-8warps"],
)
def test_fused_gate_up_equals_silu_of_gate_times_up(config, launches):
    """A program's weight rows are half gate rows, half their up rows: N = 37 leaves a
    partial block of output rows at 8, 16 and 32 of each; 3 panels a partial last step at 2
    and 4 a step."""
    packed, w = make_weight(2 * N, 384, 128, True)
    x = torch.randn(1, 384, generator=torch.Generator().manual_seed(0))
    gate, up = reference(x, w).float().chunk(2, dim=-1)
    y = quant_linear_silu_mul(x, packed, config=config)
    assert launches == [True] and y.shape == (1, N)
    torch.testing.assert_close(y, F.silu(gate) * up, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("splits", [2, 5])
def test_split_panels_sum_in_one_launch_and_leave_the_counters_zero(splits, launches):
    """K split over programs: the last of a block of rows to finish adds the splits' sums
    (split order, so a repeat is bit-equal), with the bias, or SiLU·up for gate_up."""
    from nanoqwen.kernels.triton.counters import zeroed_counters

    packed, w = make_weight(2 * N, 640, 128, True, seed=splits)
    gen = torch.Generator().manual_seed(splits)
    x = torch.randn(1, 640, generator=gen)
    bias = torch.randn(2 * N, generator=gen)
    config = MmaGemvConfig(16, 1, splits=splits)
    y = quant_linear(x, packed, bias, config=config)
    torch.testing.assert_close(y.double(), reference(x, w, bias), rtol=1e-5, atol=1e-4)
    assert torch.equal(quant_linear(x, packed, bias, config=config), y)
    fused = quant_linear_silu_mul(x, packed, config=config)
    gate, up = reference(x, w).float().chunk(2, dim=-1)
    torch.testing.assert_close(fused, F.silu(gate) * up, rtol=1e-4, atol=1e-4)
    assert launches == [False, False, True]
    assert not zeroed_counters(x.device, 1, "int4 gemv splits").any()


def test_float16_activations_round_once_to_float16(launches):
    packed, w = make_weight(N, 256, 128, True)
    x = torch.randn(1, 256).half()
    y = quant_linear(x, packed)
    assert launches == [False] and y.dtype == torch.float16
    torch.testing.assert_close(y.double(), reference(x, w), rtol=1e-3, atol=1e-3)


def test_which_weights_take_the_tensor_cores():
    x_gpu_bf16 = torch.empty(1, 256, dtype=torch.bfloat16, device="meta")
    x_gpu_fp32 = torch.empty(1, 256, dtype=torch.float32, device="meta")
    g128, _ = make_weight(4, 256, 128, False)
    g64, _ = make_weight(4, 256, 64, False)
    per_channel, _ = make_weight(4, 256, 256, False)
    q8 = pack_for_triton(torch.zeros(4, 256, dtype=torch.int8), torch.ones(4, 2), None, 128, 8)
    assert mma_gemv_fits(x_gpu_bf16, g128) and mma_gemv_fits(x_gpu_bf16, per_channel)
    assert not mma_gemv_fits(x_gpu_bf16, g64)  # a group smaller than a panel
    assert not mma_gemv_fits(x_gpu_bf16, q8)
    # float32 stays on the exact CUDA-core kernel on a GPU (tf32 tensor cores would round x)
    assert not mma_gemv_fits(x_gpu_fp32, g128)


def test_mlp_runs_one_row_of_a_quantized_gate_up_through_the_fused_gemv(launches):
    """MLP.forward at one row takes the GEMV with SiLU·up in its epilogue when gate_up is a
    QuantizedLinear on the Triton kernels (the CUDA layout, packed here for the interpreter),
    and gives what the unfused path gives."""
    from nanoqwen.model.layers import MLP
    from nanoqwen.quant.format import dequantize, quantize_int4
    from nanoqwen.quant.linear import QuantizedLinear, cuda_pack

    gen = torch.Generator().manual_seed(0)
    mlp = MLP(256, 64, torch.float32, "cpu")
    mlp.down_proj.weight.data.copy_(torch.randn(256, 64, generator=gen) * 0.1)
    gate_up = QuantizedLinear(quantize_int4(torch.randn(128, 256, generator=gen) * 0.1, 128), None)
    gate_up._decode, gate_up.kind = (cuda_pack(gate_up.weight),), "triton"
    mlp.gate_up_proj = gate_up
    x = torch.randn(1, 256, generator=gen)
    fused = mlp(x)
    assert launches == [True]  # the fused GEMV, not quant_linear then SiLU·up
    gate, up = reference(x, dequantize(gate_up.weight).double()).float().chunk(2, dim=-1)
    torch.testing.assert_close(fused, mlp.down_proj(F.silu(gate) * up), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "config",
    [
        None,
        MmaGemvConfig(16, 1),
        MmaGemvConfig(32, 2),
        MmaGemvConfig(16, 8),
        MmaGemvConfig(16, 1, splits=3),
        MmaGemvConfig(32, 2, splits=2),
    ],  # fmt: skip
    ids=["default", "16x1", "32x2", "16x8", "16x1-3splits", "32x2-2splits"],
)
def test_first_step_loaded_ahead_gives_the_same_bits(config, monkeypatch):
    """On a GPU that launches it as a programmatic dependent, the first step's weights are
    loaded before the loop (and the wait for x): here without the wait, bit for bit the
    in-loop result, over 5 panels (a partial last step at 2 and 4 panels a step)."""
    packed, w = make_weight(2 * N, 640, 128, True, seed=7)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 640, generator=gen)
    bias = torch.randn(2 * N, generator=gen)
    results = []
    for ahead in (False, True):
        monkeypatch.setattr(quant_gemv_mma, "first_step_ahead", lambda pdl, silu, a=ahead: a)
        results.append(
            (quant_linear(x, packed, bias, config=config), quant_linear_silu_mul(x, packed, config))
        )
    (linear, fused), (linear_ahead, fused_ahead) = results
    torch.testing.assert_close(linear.double(), reference(x, w, bias), rtol=1e-5, atol=1e-4)
    assert torch.equal(linear_ahead, linear) and torch.equal(fused_ahead, fused)


@pytest.mark.parametrize(
    "config",
    [None, MmaGemvConfig(16, 1, splits=3), MmaGemvConfig(32, 2)],
    ids=["default", "16x1-3splits", "32x2"],
)
def test_a_residual_add_after_the_product_finishes_the_stream(config):
    """quant_linear_add: the product plus the residual (the next residual stream, as the
    plain product and an add give it), each block of rows' sum of squares, and the stream
    times the next norm's weight."""
    from nanoqwen.kernels.triton.quant_matmul import quant_linear_add

    packed, _ = make_weight(N, 384, 128, True, seed=3)
    gen = torch.Generator().manual_seed(3)
    x, residual = torch.randn(1, 384, generator=gen), torch.randn(1, N, generator=gen)
    bias, norm_weight = torch.randn(N, generator=gen), torch.rand(N, generator=gen) + 0.5
    stream, squares, weighted = quant_linear_add(x, packed, bias, residual, norm_weight, config)
    assert torch.equal(stream, quant_linear(x, packed, bias, config=config) + residual)
    rows = (config or quant_gemv_mma.mma_gemv_config(N, 384)).rows
    blocks = stream[0].split(rows)
    assert squares.shape == (1, len(blocks))
    torch.testing.assert_close(squares[0], torch.stack([(b * b).sum() for b in blocks]))
    assert torch.equal(weighted, stream * norm_weight)
    _, _, none = quant_linear_add(x, packed, bias, residual, None, config)
    assert none is None


@pytest.mark.parametrize(
    "config",
    [None, MmaGemvConfig(16, 1, splits=3), MmaGemvConfig(32, 2)],
    ids=["default", "16x1-3splits", "32x2"],
)
@pytest.mark.parametrize("silu_mul", [False, True], ids=["linear", "silu_mul"])
def test_the_norms_scale_multiplies_the_sums(config, silu_mul):
    """quant_linear_normed: the product of a row's RMSNorm given as its weighted row and
    partial sums of squares: the 1 / RMS from those sums times the product of the weighted
    row, before the bias or SiLU·up."""
    from nanoqwen.kernels.triton.quant_matmul import quant_linear_normed

    rows = 2 * N if silu_mul else N
    packed, w = make_weight(rows, 384, 128, True, seed=4)
    gen = torch.Generator().manual_seed(4)
    stream, norm_weight = torch.randn(1, 384, generator=gen), torch.rand(384, generator=gen)
    squares = torch.stack([(c * c).sum() for c in stream[0].split(100)])[None]
    weighted = stream * norm_weight
    bias = None if silu_mul else torch.randn(N, generator=gen)
    y = quant_linear_normed(weighted, packed, bias, squares, 1e-6, silu_mul, config)
    rstd = torch.rsqrt(stream.double().pow(2).mean() + 1e-6)
    product = reference(weighted, w) * rstd
    if silu_mul:
        gate, up = product.chunk(2, dim=-1)
        torch.testing.assert_close(y.double(), F.silu(gate) * up, rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(y.double(), product + bias.double(), rtol=1e-5, atol=1e-4)


def test_int4_layers_sum_their_rows_and_generate_what_the_norms_in_front_generate(
    tmp_path, monkeypatch
):
    """Batch-1 decode through int4 layers on the tensor-core GEMV (the CUDA layout, packed
    here for the interpreter): o_proj and down_proj add the residual and weigh the stream by
    the norm behind, qkv and gate_up take the norm's 1 / RMS from the squares
    (model/summed_row.py), and the greedy tokens and their logprobs are those of the same
    layers with add+RMSNorm in front."""
    from conftest import write_tiny_model

    from nanoqwen import LLM, SamplingParams
    from nanoqwen.kernels.triton import quant_matmul
    from nanoqwen.model.quantize import install, linear_names
    from nanoqwen.model.qwen2 import DecoderLayer
    from nanoqwen.quant.format import quantize_int4
    from nanoqwen.quant.linear import QuantizedLinear, cuda_pack

    write_tiny_model(tmp_path, hidden_size=128, intermediate_size=256)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    adds = []
    add = quant_matmul.quant_linear_add
    monkeypatch.setattr(quant_matmul, "quant_linear_add", lambda *a: adds.append(a[4]) or add(*a))

    def generate(summed: bool):
        llm = LLM(str(tmp_path), dtype="float32", progress=False)
        model = llm.runner.model
        names = linear_names(model)
        install(model, {n: quantize_int4(model.get_submodule(n).weight, 128) for n in names},
                torch.float32)  # fmt: skip
        for m in model.modules():
            if isinstance(m, QuantizedLinear):
                m._decode, m.kind = (cuda_pack(m.weight),), "triton"
        assert all(layer.sums_rows == summed for layer in model.layers)
        out = llm.generate([[5, 17, 99, 3]], params)[0]
        return out.token_ids, [e.logprob for e in out.logprobs]

    with monkeypatch.context() as m:
        m.setattr(DecoderLayer, "sums_rows", property(lambda self: False))
        outputs = {False: generate(False)}
    assert not adds
    outputs[True] = generate(True)
    # 5 decode steps, 2 layers: o_proj weighs by its post-attention norm, down_proj by the
    # next layer's input norm, the last layer's by none (the final norm runs as before)
    assert len(adds) == 5 * 4 and sum(a is None for a in adds) == 5
    assert outputs[True][0] == outputs[False][0]
    # float32: the 1 / RMS multiplies the sums instead of x, and the codes' 128 (see above)
    assert outputs[True][1] == pytest.approx(outputs[False][1], abs=5e-4)
