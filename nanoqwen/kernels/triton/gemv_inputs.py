"""The input row of a batch-1 product (gemv.py, stream_gemv.py): x, or with the add+RMSNorm
in front folded in, RMSNorm(x + residual) * norm weight, rounded as rms_norm.py rounds it.
Every program normalizes the row for itself (its 1-4K values are a few µs of L2 reads at
most), so no kernel of its own runs in front.

The sum of squares only loads, over a loop unrolled at compile time: with the store of x +
residual inside that loop (sm_90 SASS), no chunk's loads could issue before the previous
chunk's store, and each program of 7B's qkv, gate_up and lm_head waited on 14 L2 round trips
in a row. The store goes with the product's own pass over the row instead (gemv_input).

Where the kernel in front finished the row as the residual stream with its sum of squares in
parts (split_sums.py, ADD_RES), x is that row and the 1 / RMS comes from the parts
(squares_rstd): no residual to load or store, and a few hundred floats where every value was
read."""

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
def row_rstd(x_ptr, res_ptr, K, eps, HAS_RES: tl.constexpr, BK: tl.constexpr,
             CHUNKS: tl.constexpr, WIDTH: tl.constexpr = 0):  # fmt: skip
    """1 / RMS of x + residual over its K values, CHUNKS = cdiv(K, BK) chunks: every load can
    be in flight at once. WIDTH (a power of two >= K): in one load that wide, as rms_norm.py
    reads the row: a few 16-byte loads a thread instead of a load a chunk."""
    if WIDTH:
        cols = tl.arange(0, WIDTH)
        v = input_chunk(x_ptr, res_ptr, cols, cols < K, HAS_RES).to(tl.float32)
        return tl.rsqrt(tl.sum(v * v, axis=0) / K + eps)
    squares = tl.zeros([BK], tl.float32)
    for c in tl.static_range(CHUNKS):
        cols = c * BK + tl.arange(0, BK)
        v = input_chunk(x_ptr, res_ptr, cols, cols < K, HAS_RES).to(tl.float32)
        squares += v * v
    return tl.rsqrt(tl.sum(squares, axis=0) / K + eps)


@triton.jit
def squares_rstd(sq_ptr, NB, K, eps, NB_PAD: tl.constexpr):
    """1 / RMS of a row whose sum of squares is in NB partial sums (split_sums.finish_rows
    with ADD_RES), added in one fixed order."""
    return parts_rstd(square_parts(sq_ptr, NB, NB_PAD), K, eps)


@triton.jit
def square_parts(sq_ptr, NB, NB_PAD: tl.constexpr):
    """squares_rstd's loads, for a kernel to issue long before it needs the sum. They skip
    L1, which may hold an earlier launch's sums."""
    i = tl.arange(0, NB_PAD)
    return tl.load(sq_ptr + i, mask=i < NB, other=0.0, cache_modifier=".cg")


@triton.jit
def parts_rstd(parts, K, eps):
    return tl.rsqrt(tl.sum(parts, axis=0) / K + eps)


@triton.jit
def raw_input(x_ptr, res_ptr, nw_ptr, cols, c_mask, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """gemv_input's loads at cols: (x, or x + residual rounded, and with NORM the norm
    weight), so that a kernel can issue several chunks' loads before it uses any."""
    v = input_chunk(x_ptr, res_ptr, cols, c_mask, HAS_RES and NORM)
    nw = v
    if NORM:
        nw = tl.load(nw_ptr + cols, mask=c_mask, other=0.0)
    return v, nw


@triton.jit
def input_from(v, nw, sum_ptr, cols, c_mask, rstd, store, NORM: tl.constexpr,
               SUM: tl.constexpr, dtype: tl.constexpr):  # fmt: skip
    """gemv_input from raw_input's values."""
    if NORM:
        return normed_input(v, nw, sum_ptr, cols, c_mask, rstd, store, SUM, dtype)
    return v.to(tl.float32)[None, :]


@triton.jit
def gemv_input(x_ptr, res_ptr, nw_ptr, sum_ptr, cols, c_mask, rstd, store, NORM: tl.constexpr,
               HAS_RES: tl.constexpr, SUM: tl.constexpr, dtype: tl.constexpr):  # fmt: skip
    """The product's input at cols, [1, len(cols)] in float32: x, or with NORM the
    normalized x + residual times the norm weight (normed_input)."""
    # the norm weight is loaded before the store, which the compiler keeps every later load
    # behind
    v, nw = raw_input(x_ptr, res_ptr, nw_ptr, cols, c_mask, NORM, HAS_RES)
    return input_from(v, nw, sum_ptr, cols, c_mask, rstd, store, NORM, SUM, dtype)


@triton.jit
def normed_input(v, nw, sum_ptr, cols, c_mask, rstd, store, SUM: tl.constexpr,
                 dtype: tl.constexpr):  # fmt: skip
    """[1, len(cols)] float32: x + residual (v, at cols) normalized and times the norm
    weight nw. With SUM, where `store` holds, v is stored to sum_ptr (the residual stream's
    next value): the launch picks programs whose columns cover the row once."""
    if SUM:
        tl.store(sum_ptr + cols, v, mask=c_mask & store)
    normed = (v.to(tl.float32) * rstd).to(dtype)
    return (normed.to(tl.float32) * nw.to(tl.float32)).to(dtype).to(tl.float32)[None, :]
