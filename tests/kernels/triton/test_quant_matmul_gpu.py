"""The weight-only quantized linear kernels compiled for the GPU, at the Qwen2.5 0.5B and 7B
projection shapes in bfloat16, against x @ dequantized(w).T in float32; and replayed from a
CUDA graph, equal to eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from graph_replay import assert_replays_eager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# name: (N, K) with fused qkv and gate_up, as the model holds them.
SHAPES = {
    "0.5B-qkv": (1152, 896),
    "0.5B-o": (896, 896),
    "0.5B-gate_up": (9728, 896),
    "0.5B-down": (896, 4864),
    "0.5B-lm_head": (151936, 896),
    "7B-qkv": (4608, 3584),
    "7B-o": (3584, 3584),
    "7B-gate_up": (37888, 3584),
    "7B-down": (3584, 18944),
    "7B-lm_head": (152064, 3584),
}
# (bits, group, offset): GGUF-like int4 with a min, symmetric int4, int4 with a min in groups
# of 128 (quantization="int4" on a GPU), int8 per channel.
FORMATS = [(4, 32, True), (4, 128, False), (4, 128, True), (8, None, False)]


def quantized(n: int, k: int, bits: int, group: int | None, offset: bool, seed: int = 0):
    """A packed random weight and its float32 dequantization, weights ~0.02 like a model's."""
    from nanoqwen.kernels.triton.quant_matmul import pack_for_triton

    group = group or k
    gen = torch.Generator(device="cuda").manual_seed(seed)
    g = k // group
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=gen, device="cuda", dtype=torch.uint8)
        scale = torch.rand(n, g, generator=gen, device="cuda") * 0.004 + 0.002
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen, device="cuda", dtype=torch.int8)
        scale = torch.rand(n, g, generator=gen, device="cuda") * 2e-4 + 1e-4
    off = -7.5 * scale if offset else None
    w = q.float() * scale.repeat_interleave(group, 1)
    if off is not None:
        w += off.repeat_interleave(group, 1)
    return pack_for_triton(q, scale, off, group, bits), w


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias, weight_rounded: bool):
    """bf16 output of a float32 sum; the tensor-core GEMM also rounds each weight to bf16."""
    ref = F.linear(x.float(), w.to(x.dtype).float() if weight_rounded else w, bias.float())
    assert y.dtype == x.dtype and y.shape == ref.shape
    scale = ref.abs().mean().item()
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(
    ("bits", "group", "offset"), FORMATS, ids=["q4-g32", "q4-g128", "q4-g128o", "q8"]
)
def test_real_shapes_equal_the_dequantized_product(shape, bits, group, offset):
    from nanoqwen.kernels.triton import quant_matmul
    from nanoqwen.kernels.triton.quant_matmul import quant_linear

    n, k = SHAPES[shape]
    packed, w = quantized(n, k, bits, group, offset)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1
    for m in (1, 4, 16, 64, quant_matmul.DEQUANT_MIN_M):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        check(quant_linear(x, packed, bias), x, w, bias, weight_rounded=m > 1)


@pytest.mark.parametrize("shape", ["0.5B-qkv", "0.5B-lm_head", "7B-o", "7B-down"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [False, True], ids=["sym", "asym"])
def test_tensor_core_gemv_equals_cuda_core_gemv(shape, dtype, offset):
    """The PTX unpacking and tl.dot give the float32 sums of the same exact products as the
    CUDA-core GEMV, in another order: the outputs agree to a rounding step of the dtype."""
    from nanoqwen.kernels.triton.quant_gemv import gemv_config, sm_count
    from nanoqwen.kernels.triton.quant_matmul import quant_linear

    n, k = SHAPES[shape]
    packed, w = quantized(n, k, 4, 128, offset)
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    tensor_cores = quant_linear(x, packed)
    cuda_cores = quant_linear(x, packed, config=gemv_config(n, k, 4, sm_count(x.device)))
    step = 2**-7 if dtype == torch.bfloat16 else 2**-10
    scale = cuda_cores.float().abs().mean().item()
    torch.testing.assert_close(
        tensor_cores.float(), cuda_cores.float(), rtol=step, atol=step * scale
    )
    ref = F.linear(x.double(), w.double()).float()
    torch.testing.assert_close(tensor_cores.float(), ref, rtol=step, atol=step * scale)


def test_packed_on_the_cpu_and_moved_equals_packed_on_the_gpu():
    from nanoqwen.kernels.triton.quant_matmul import pack_for_triton, quant_linear

    n, k = SHAPES["0.5B-qkv"]
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale = torch.rand(n, k // 32) * 0.004 + 0.002
    offset = -7.5 * scale
    moved = pack_for_triton(q, scale, offset, 32, 4).to("cuda")
    on_gpu = pack_for_triton(q.cuda(), scale.cuda(), offset.cuda(), 32, 4)
    assert moved.qweight.device.type == "cuda" and torch.equal(moved.qweight, on_gpu.qweight)
    x = torch.randn(3, k, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(quant_linear(x, moved), quant_linear(x, on_gpu))


@pytest.mark.parametrize("shape", ["0.5B-gate_up", "7B-gate_up"])
def test_fused_gate_up_equals_silu_times_up(shape):
    from nanoqwen.kernels.triton.quant_matmul import quant_linear, quant_linear_silu_mul

    n, k = SHAPES[shape]
    packed, _ = quantized(n, k, 4, 32, True)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    gate, up = quant_linear(x, packed).chunk(2, dim=-1)
    expected = (F.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)
    # The same fp32 sums round to bf16 first in both; SiLU's float32 formula may differ in
    # the last bit, so a bf16 step apart at most.
    torch.testing.assert_close(quant_linear_silu_mul(x, packed), expected, rtol=1.6e-2, atol=1e-5)


@pytest.mark.parametrize("m", [1, 8, 64])
def test_cuda_graph_replay_equals_eager(m):
    """Every path a decode graph captures (GEMV, fused gate_up, split-K GEMM) replays the
    eager result bit for bit, with new inputs copied into the captured buffer."""
    from nanoqwen.kernels.triton.quant_matmul import quant_linear, quant_linear_silu_mul

    qkv, _ = quantized(*SHAPES["7B-qkv"], 4, 32, True)
    down, _ = quantized(*SHAPES["7B-down"], 8, None, False)
    gate_up, _ = quantized(*SHAPES["0.5B-gate_up"], 4, 128, False)
    bias = torch.randn(qkv.out_features, device="cuda", dtype=torch.bfloat16)

    def step(x, h):
        return (
            quant_linear(x, qkv, bias),
            quant_linear(h.repeat(1, 18944 // 896 + 1)[:, :18944], down),
            quant_linear_silu_mul(h, gate_up),
        )

    x = torch.zeros(m, 3584, device="cuda", dtype=torch.bfloat16)
    h = torch.zeros(m, 896, device="cuda", dtype=torch.bfloat16)
    assert_replays_eager(step, x, h)


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("shape", ["7B-qkv", "7B-down", "7B-gate_up"])
def test_tensor_core_gemv_split_over_programs_equals_one_program(shape, splits):
    """K split over programs (the last to finish sums): the same float32 sums in another
    order, a rounding step of bf16 apart at most; repeated, eager and replayed from a CUDA
    graph, bit for bit the same."""
    from nanoqwen.kernels.triton.quant_gemv_mma import MmaGemvConfig, mma_gemv_config
    from nanoqwen.kernels.triton.quant_matmul import quant_linear, quant_linear_silu_mul

    n, k = SHAPES[shape]
    packed, _ = quantized(n, k, 4, 128, True)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    one = mma_gemv_config(n, k)
    split = MmaGemvConfig(one.rows, one.panels, one.num_warps, one.num_stages, splits)
    gate_up = shape.endswith("gate_up")

    def run(cfg):
        if gate_up:
            return quant_linear_silu_mul(x, packed, config=cfg)
        return quant_linear(x, packed, config=cfg)

    want, got = run(one), run(split)
    scale = want.float().abs().mean().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7 * scale)
    assert torch.equal(run(split), got)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(split)
    for _ in range(3):
        graph.replay()
        assert torch.equal(out, got)
