"""QuantizedLinear against F.linear over its dequantized float32 weight.

float32 activations are the exact mode: every kernel (torch's int4 and int8 packed GEMVs for
few rows, the float32 dequantization for many) matches the reference to float32 rounding.
bf16 activations differ by bf16 rounding, and many-row bf16 matmuls also by the int8
rounding of each activation row (the int8 x int8 prefill matmul).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoqwen.quant.format import QuantizedWeight, dequantize, quantize_int4, quantize_int8
from nanoqwen.quant.linear import CPU_PACKED_MAX_ROWS, QuantizedEmbedding, QuantizedLinear

N, K = 96, 256
LAYOUTS = {
    "int4 group 32": lambda w: quantize_int4(w, 32),
    "int4 group 128": lambda w: quantize_int4(w, 128),
    "int8 per channel": lambda w: quantize_int8(w),
    "int8 group 32 (no kernel)": lambda w: quantize_int8(w, 32),
}
KINDS = {
    "int4 group 32": "int4pack",
    "int4 group 128": "int4pack",
    "int8 per channel": "int8pack",
    "int8 group 32 (no kernel)": "dequant",
}


def _layer(layout: str, dtype: torch.dtype, bias: bool = True):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=gen) * 0.05
    qw = LAYOUTS[layout](w)
    b = torch.randn(N, generator=gen) if bias else None
    layer = QuantizedLinear(qw, None if b is None else b.clone())
    layer.prepare(dtype)
    return layer, dequantize(qw), b


@pytest.mark.parametrize("rows", [1, CPU_PACKED_MAX_ROWS, CPU_PACKED_MAX_ROWS + 1, 37])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_float32_equals_dequantized_reference(layout, rows):
    layer, ref_w, b = _layer(layout, torch.float32)
    assert layer.kind == KINDS[layout]
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(1))
    ref = F.linear(x.double(), ref_w.double(), b.double())
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, N)
    # float32 accumulation of K=256 products of size ~1: a few ulps of the row's magnitude.
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-5 * ref.abs().max().item())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bfloat16_close_to_reference(layout):
    layer, ref_w, b = _layer(layout, torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 37):  # the packed GEMV, then the int8 x int8 matmul
        x = torch.randn(rows, K, generator=gen).bfloat16()
        ref = F.linear(x.double(), ref_w.double(), b.double())
        got = layer(x)
        assert got.dtype == torch.bfloat16
        err = (got.double() - ref).abs().max().item() / ref.abs().max().item()
        # bf16 keeps 8 mantissa bits (2**-8 relative); int8 rows add ~K**0.5 / 254 / 127.
        assert err < 0.02, f"{rows} rows: relative error {err:.4f}"


def test_int4_codes_keep_gguf_offsets_exactly():
    """An int4 weight without offset (symmetric codes) and one with: both exact in float32."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.uint8)
    scale = torch.rand(32, 2, generator=gen)
    for offset in (None, -8 * scale):
        w = QuantizedWeight(q, scale, offset, 32, 4)
        layer = QuantizedLinear(w, None)
        layer.prepare(torch.float32)
        x = torch.randn(1, 64, generator=gen)
        torch.testing.assert_close(layer(x), x @ dequantize(w).T, rtol=1e-6, atol=1e-5)


def test_embedding_lookup_dequantizes_only_the_rows_it_gathers():
    qw = quantize_int8(torch.randn(50, 64, generator=torch.Generator().manual_seed(4)), 32)
    emb = QuantizedEmbedding(qw, torch.float32)
    ids = torch.tensor([3, 3, 49, 0])
    assert torch.equal(emb[ids], dequantize(qw)[ids])
    assert emb.shape == (50, 64) and emb.device.type == "cpu"


def test_quantizers_round_to_nearest_level():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    q8 = quantize_int8(w)
    # Symmetric int8: error at most half a step, the step being max|w| / 127 per row.
    step8 = w.abs().amax(1, keepdim=True) / 127
    assert ((dequantize(q8) - w).abs() <= step8 / 2 + 1e-6).all()
    q4 = quantize_int4(w, 32)
    groups = w.view(8, 2, 32)
    step4 = (groups.amax(-1) - groups.amin(-1)) / 15
    err = (dequantize(q4) - w).abs().view(8, 2, 32)
    assert (err <= step4.unsqueeze(-1) / 2 + 1e-6).all()
    assert q4.q.max() <= 15 and q8.q.abs().max() <= 127
