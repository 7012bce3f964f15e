"""The input row of a batch-1 product (gemv.py, stream_gemv.py): x, or with the add+RMSNorm
in front folded in, RMSNorm(x + residual) * norm weight, rounded as rms_norm.py rounds it.
Every program normalizes the row for itself (its 1-4K values are a few µs of L2 reads at
most), so no kernel of its own runs in front."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def input_chunk(x_ptr, res_ptr, cols, c_mask, HAS_RES: tl.constexpr):
    """The input row's values at cols: x, or x + residual rounded to x's dtype (HF's
    residual add)."""
    x = tl.load(x_ptr + cols, mask=c_mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + cols, mask=c_mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x


@triton.jit
def row_rstd(x_ptr, res_ptr, sum_ptr, K, eps, first, HAS_RES: tl.constexpr, BK: tl.constexpr):
    """1 / RMS of x + residual over its K values; the `first` program also stores x +
    residual to sum_ptr (the residual stream's next value)."""
    squares = tl.zeros([BK], tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        c_mask = cols < K
        v = input_chunk(x_ptr, res_ptr, cols, c_mask, HAS_RES)
        if HAS_RES:
            tl.store(sum_ptr + cols, v, mask=c_mask & first)
        squares += v.to(tl.float32) * v.to(tl.float32)
    return tl.rsqrt(tl.sum(squares, axis=0) / K + eps)


@triton.jit
def gemv_input(x_ptr, res_ptr, nw_ptr, cols, c_mask, rstd, NORM: tl.constexpr,
               HAS_RES: tl.constexpr, dtype: tl.constexpr):  # fmt: skip
    """The product's input at cols, [1, len(cols)] in float32: x, or with NORM the
    normalized x + residual times the norm weight."""
    if NORM:
        v = input_chunk(x_ptr, res_ptr, cols, c_mask, HAS_RES)
        normed = (v.to(tl.float32) * rstd).to(dtype)
        nw = tl.load(nw_ptr + cols, mask=c_mask, other=0.0)
        return (normed.to(tl.float32) * nw.to(tl.float32)).to(dtype).to(tl.float32)[None, :]
    return tl.load(x_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
