"""The weight-only quantized linear kernels against x @ dequantized(w).T, in Triton's CPU
interpreter (tests/conftest.py; float32 and float16 there), and pack_for_triton's checks.

Small shapes keep the interpreter fast; tests/kernels/triton/test_quant_matmul_gpu.py runs the real
Qwen2.5 shapes in bfloat16 on a GPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter"
)
from nanoqwen.kernels.triton import quant_matmul  # noqa: E402
from nanoqwen.kernels.triton.quant_gemm import GemmConfig, dequantize  # noqa: E402
from nanoqwen.kernels.triton.quant_gemv import GemvConfig  # noqa: E402
from nanoqwen.kernels.triton.quant_matmul import (  # noqa: E402
    pack_for_triton,
    quant_linear,
    quant_linear_silu_mul,
)

N = 37  # leaves a partial block of output rows in every kernel


def make_weight(n: int, k: int, bits: int, group: int, offset: bool, seed: int = 0):
    """Canonical quantized weight (q, scale, offset) and its float64 dequantization."""
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    s = (torch.rand(n, k // group, generator=gen) + 0.5) * (0.04 if bits == 4 else 0.004)
    o = torch.randn(n, k // group, generator=gen) * 0.1 if offset else None
    w = q.double() * s.double().repeat_interleave(group, 1)
    if o is not None:
        w += o.double().repeat_interleave(group, 1)
    return (q, s, o), w


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w, None if bias is None else bias.double())


# (bits, K, group): groups smaller than, equal to and larger than a kernel step, and one
# scale per row (per channel) at a K that is not a power of two.
GROUPINGS = [(4, 256, 16), (4, 256, 64), (4, 192, 192), (8, 256, 32), (8, 256, 128), (8, 96, 96)]


@pytest.mark.parametrize(("bits", "k", "group"), GROUPINGS)
@pytest.mark.parametrize(("offset", "bias"), [(False, False), (True, True)], ids=["sym", "asym"])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_quant_linear_equals_dequantized_linear(bits, k, group, offset, bias, m):
    (q, s, o), w = make_weight(N, k, bits, group, offset, seed=m + k + group)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(N, generator=gen) if bias else None
    y = quant_linear(x, pack_for_triton(q, s, o, group, bits), b)
    assert y.shape == (m, N) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), reference(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("offset", "bias"), [(True, False), (False, True)])
@pytest.mark.parametrize("m", [1, 5])
def test_offset_and_bias_each_alone(offset, bias, m):
    (q, s, o), w = make_weight(N, 128, 4, 32, offset)
    x = torch.randn(m, 128)
    b = torch.randn(N) if bias else None
    y = quant_linear(x, pack_for_triton(q, s, o, 32, 4), b)
    torch.testing.assert_close(y.double(), reference(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "config",
    [GemvConfig(rows=2, panels=1), GemvConfig(rows=16, panels=4), GemmConfig(16, 16, split_k=4)],
    ids=["gemv-2x1", "gemv-16x4", "gemm-split4"],
)
def test_every_launch_shape_gives_the_same_product(bits, config):
    """The tile sizes the benchmark sweeps, and K split four ways (partial sums + reduce)."""
    (q, s, o), w = make_weight(N, 320, bits, 64, True)
    m = 1 if isinstance(config, GemvConfig) else 6
    x = torch.randn(m, 320)
    b = torch.randn(N)
    y = quant_linear(x, pack_for_triton(q, s, o, 64, bits), b, config=config)
    torch.testing.assert_close(y.double(), reference(x, w, b), rtol=1e-5, atol=1e-4)


def test_float16_activations_round_once_to_float16():
    (q, s, o), w = make_weight(N, 256, 4, 64, True)
    packed = pack_for_triton(q, s, o, 64, 4)
    # One row dequantizes in float32; the GEMM rounds each weight to float16 for the tensor
    # cores. Either way the output is a float32 sum rounded once to float16.
    for m, weight in ((1, w), (4, w.half().double())):
        x = torch.randn(m, 256).half()
        y = quant_linear(x, packed)
        assert y.dtype == torch.float16
        torch.testing.assert_close(y.double(), reference(x, weight, None), rtol=1e-3, atol=1e-3)


def test_many_rows_dequantize_and_match(monkeypatch):
    monkeypatch.setattr(quant_matmul, "DEQUANT_MIN_M", 8)
    (q, s, o), w = make_weight(N, 128, 8, 16, True)
    packed = pack_for_triton(q, s, o, 16, 8)
    torch.testing.assert_close(dequantize(packed, torch.float32), w.float())
    x = torch.randn(20, 128)
    b = torch.randn(N)
    y = quant_linear(x, packed, b)
    torch.testing.assert_close(y.double(), reference(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 3])
def test_fused_gate_up_equals_silu_of_gate_times_up(m):
    (q, s, o), w = make_weight(2 * N, 256, 4, 32, True)
    x = torch.randn(m, 256)
    gate, up = reference(x, w, None).float().chunk(2, dim=-1)
    y = quant_linear_silu_mul(x, pack_for_triton(q, s, o, 32, 4))
    # float32 sums of 256 products in the kernel's order against the double reference's:
    # up to ~3e-5 apart on sums near 1 (1e-5 failed one CI run in dozens)
    torch.testing.assert_close(y, F.silu(gate) * up, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [1, 3])
def test_float16_scales_on_request_where_exact(m):
    (q, s, o), _ = make_weight(N, 128, 4, 32, True)
    s, o = s.half().float(), o.half().float()
    assert pack_for_triton(q, s, o, 32, 4).scales.dtype == torch.float32
    packed = pack_for_triton(q, s, o, 32, 4, scale_dtype=torch.float16)
    assert packed.scales.dtype == packed.offsets.dtype == torch.float16
    w = q.double() * s.double().repeat_interleave(32, 1) + o.double().repeat_interleave(32, 1)
    x = torch.randn(m, 128)
    torch.testing.assert_close(quant_linear(x, packed).double(), reference(x, w, None),
                               rtol=1e-5, atol=1e-4)  # fmt: skip
    # int4 words plus a float16 scale and offset per 32 values: 5 bits a weight.
    assert packed.nbytes == N * 128 // 2 + 2 * N * 4 * 2
    with pytest.raises(ValueError, match="exact in float16"):
        pack_for_triton(q, s + 1e-6, o, 32, 4, scale_dtype=torch.float16)


def test_x_of_the_wrong_width_is_rejected():
    (q, s, o), _ = make_weight(N, 128, 4, 32, False)
    with pytest.raises(ValueError, match=r"x must be \[M, 128\]"):
        quant_linear(torch.randn(1, 64), pack_for_triton(q, s, o, 32, 4))


def _bad_inputs():
    (q4, s, o), _ = make_weight(8, 64, 4, 16, True)
    q8 = q4.to(torch.int8)
    too_big = q4.clone()
    too_big[3, 5] = 16
    return [
        ((q4, s, o, 16, 3), ValueError, "bits must be 4 or 8"),
        ((q8, s, o, 16, 4), TypeError, "q must be torch.uint8 for bits=4"),
        ((q4, s, o, 16, 8), TypeError, "q must be torch.int8 for bits=8"),
        ((too_big, s, o, 16, 4), ValueError, "q holds 16, outside 0..15"),
        ((q4[0], s, o, 16, 4), ValueError, "q must be 2-D"),
        ((q4, s[:, :2], o[:, :2], 24, 4), ValueError, "group_size must divide K=64"),
        ((q4[:, :48], s[:, :2], o[:, :2], 24, 4), ValueError, "power of two >= 16 or K=48"),
        ((q4, s.double(), o, 16, 4), TypeError, "scale must be float32"),
        ((q4, s, o.half(), 16, 4), TypeError, "offset must be float32"),
        ((q4, s[:, :2], o, 16, 4), ValueError, r"scale must have shape \[8, 4\]"),
        ((q4, s.index_fill(0, torch.tensor([1]), float("nan")), o, 16, 4), ValueError,
         "scale holds non-finite values"),
        ((q4, s, o, 16, 4, torch.bfloat16), ValueError, "scale_dtype must be torch.float32"),
    ]  # fmt: skip


@pytest.mark.parametrize(("args", "error", "message"), _bad_inputs())
def test_pack_for_triton_rejects_bad_inputs(args, error, message):
    with pytest.raises(error, match=message):
        pack_for_triton(*args)
