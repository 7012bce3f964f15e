"""The streamed batch-1 GEMV (kernels/triton/stream_gemv.py) compiled for the GPU at 7B's
projection shapes in bfloat16: against the float32 product, with the bias, SiLU·up and the
add+RMSNorm in front, split or not over programs; chained as programmatic dependents in a
CUDA graph, bit for bit the eager result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from graph_replay import assert_replays_eager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# name: (weight rows, columns, bias, SiLU·up), as the 7B model holds them.
SHAPES = {
    "qkv": (4608, 3584, True, False),
    "o": (3584, 3584, False, False),
    "gate_up": (37888, 3584, False, True),
    "down": (3584, 18944, False, False),
}


def weights(rows: int, k: int, bias: bool, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(rows, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(rows, generator=gen, device="cuda", dtype=torch.bfloat16) if bias else None
    return w, b


def reference(x, w, b, silu_mul: bool) -> torch.Tensor:
    y = F.linear(x.float(), w.float(), None if b is None else b.float())
    if silu_mul:
        gate, up = y.to(x.dtype).float().chunk(2, dim=-1)
        return F.silu(gate) * up
    return y


def close(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().mean().item())


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("splits", [None, 1, 4], ids=["default", "one-split", "4-splits"])
def test_streamed_projection_equals_float32_product(name, splits):
    from nanoqwen.kernels.triton.stream_gemv import (
        StreamGemvConfig,
        stream_gemv,
        stream_gemv_config,
    )

    rows, k, bias, silu = SHAPES[name]
    w, b = weights(rows, k, bias)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    cfg = None
    if splits is not None:
        base = stream_gemv_config(rows // 2 if silu else rows, k)
        cfg = StreamGemvConfig(base.rows, base.cols, splits, base.num_stages, base.num_warps)
    close(stream_gemv(x, w, b, silu_mul=silu, config=cfg), reference(x, w, b, silu))


@pytest.mark.parametrize("name", ["qkv", "gate_up"])
def test_streamed_norm_gemv_equals_rms_norm_then_the_product(name):
    from nanoqwen.kernels.triton.stream_gemv import stream_gemv

    rows, k, bias, silu = SHAPES[name]
    w, b = weights(rows, k, bias)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    nw = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
    total = (x.float() + res.float()).to(torch.bfloat16)
    var = total.float().pow(2).mean(-1, keepdim=True)
    normed = (total.float() * torch.rsqrt(var + 1e-6)).to(torch.bfloat16).float() * nw.float()
    y, new_residual = stream_gemv(x, w, b, silu_mul=silu, norm=(res, nw, 1e-6))
    assert torch.equal(new_residual, total)
    close(y, reference(normed.to(torch.bfloat16), w, b, silu))


@pytest.mark.parametrize(("vocab", "hidden"), [(151936, 896), (152064, 3584)])
def test_logits_with_the_final_norm_in_front_equal_norm_then_lm_head(vocab, hidden):
    """LayerOps.norm_logits: the final add+RMSNorm, then float32 logits from the float32
    sums, as the model's rms_norm and torch.mm(..., out_dtype=float32) give them."""
    from nanoqwen.kernels.layer_ops import triton_ops
    from nanoqwen.kernels.triton.rms_norm import rms_norm

    w, _ = weights(vocab, hidden, False)
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    nw = (torch.rand(hidden, device="cuda") + 0.5).to(torch.bfloat16)
    logits = triton_ops().norm_logits(x, res.clone(), nw, 1e-6, w)
    want = torch.mm(rms_norm(x, nw, 1e-6, res), w.t(), out_dtype=torch.float32)
    assert logits.dtype == torch.float32 and logits.shape == (1, vocab)
    torch.testing.assert_close(logits, want, rtol=1e-3, atol=1e-3 * want.abs().mean().item())


def test_a_chain_of_streamed_projections_replays_its_eager_result():
    """qkv (norm in front) -> o -> gate_up (norm in front) -> down, each a programmatic
    dependent of the one before: replayed from a CUDA graph with new inputs, bit for bit."""
    from nanoqwen.kernels.triton.stream_gemv import stream_gemv

    qkv, qkv_b = weights(*SHAPES["qkv"][:3], seed=1)
    o, _ = weights(*SHAPES["o"][:3], seed=2)
    gate_up, _ = weights(*SHAPES["gate_up"][:3], seed=3)
    down, _ = weights(*SHAPES["down"][:3], seed=4)
    nw = torch.ones(3584, device="cuda", dtype=torch.bfloat16)

    def layer(x, res):
        h, res = stream_gemv(x, qkv, qkv_b, norm=(res, nw, 1e-6))
        a = stream_gemv(h[:, :3584].contiguous(), o)
        m, res = stream_gemv(a, gate_up, silu_mul=True, norm=(res, nw, 1e-6))
        return stream_gemv(m, down), res

    x = torch.zeros(1, 3584, device="cuda", dtype=torch.bfloat16)
    assert_replays_eager(layer, x, torch.zeros_like(x))


def test_a_summed_layer_equals_the_norms_in_front_and_replays_its_eager_result():
    """One row of a layer as model/summed_row.py runs it at 7B: o_proj and down_proj add the
    residual in their epilogue and keep sums of squares, qkv and gate_up normalize from
    them. Against the same layer with the add+RMSNorm in front of qkv and gate_up, and
    replayed from a CUDA graph with new inputs, bit for bit."""
    from nanoqwen.kernels.triton.stream_gemv import stream_gemv

    qkv, qkv_b = weights(*SHAPES["qkv"][:3], seed=1)
    o, _ = weights(*SHAPES["o"][:3], seed=2)
    gate_up, _ = weights(*SHAPES["gate_up"][:3], seed=3)
    down, _ = weights(*SHAPES["down"][:3], seed=4)
    gen = torch.Generator(device="cuda").manual_seed(5)
    nw = torch.rand(3584, generator=gen, device="cuda").to(torch.bfloat16) + 0.5
    heads = torch.randn(1, 3584, generator=gen, device="cuda").to(torch.bfloat16)
    res = torch.randn(1, 3584, generator=gen, device="cuda").to(torch.bfloat16)

    def summed(heads, res):
        stream, squares = stream_gemv(heads, o, residual=res)
        h = stream_gemv(stream, qkv, qkv_b, norm=(None, nw, 1e-6), squares=squares)[0]
        stream, squares = stream_gemv(h[:, :3584].contiguous(), o, residual=stream)
        m = stream_gemv(stream, gate_up, silu_mul=True, norm=(None, nw, 1e-6),
                        squares=squares)[0]  # fmt: skip
        return stream_gemv(m, down, residual=stream)

    def in_front(heads, res):
        h, res = stream_gemv(stream_gemv(heads, o), qkv, qkv_b, norm=(res, nw, 1e-6))
        m, res = stream_gemv(stream_gemv(h[:, :3584].contiguous(), o), gate_up,
                             silu_mul=True, norm=(res, nw, 1e-6))  # fmt: skip
        return (stream_gemv(m, down).float() + res.float()).to(res.dtype)

    stream, squares = summed(heads, res)
    want = in_front(heads, res)
    torch.testing.assert_close(stream.float(), want.float(), rtol=2e-2, atol=4e-2)
    assert squares.shape == (1, 224)
    torch.testing.assert_close(squares.sum(), stream.float().pow(2).sum(), rtol=1e-4, atol=0)
    assert_replays_eager(summed, heads, res)
