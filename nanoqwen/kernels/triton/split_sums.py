"""Batch-1 products whose columns are split over programs, summed without a kernel of their
own: each program stores its float32 sums of a block of rows and counts itself in with an
atomic add; the last of the block to arrive adds every split's sums in split order (the
same result whatever the order of arrival), then the bias or SiLU·up, and stores the rows.

part_ptr: [SPLITS, width] float32, width the product's rows (N, or 2N with SiLU·up: the
gate sums, then the up sums); counts_ptr: one int32 per block of rows, zero between
launches (counters.zeroed_counters), which the last program leaves zero again.

With ADD_RES the rows finish as the next residual stream (HF's residual add after o_proj and
down_proj): y rounded, plus the residual's rows, rounded again; and each block stores its
rows' float32 sum of squares to sq_ptr[block], so that the add+RMSNorm after it takes its
1 / RMS from a few hundred partial sums (gemv_inputs.squares_rstd) instead of every value.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanoqwen.kernels.triton.counters import last_to_arrive
from nanoqwen.kernels.triton.silu_mul import _silu_mul


@triton.jit
def split_span(total, chunk, SPLITS: tl.constexpr):
    """[begin, end) of this program's split (program_id 1) of `total` columns (or panels)."""
    if SPLITS == 1:
        return 0, total
    begin = tl.program_id(1) * chunk
    return begin, tl.minimum(begin + chunk, total)


@triton.jit
def finish_split(
    part_ptr, counts_ptr, bias, y_ptr, block, split, rows, r_mask, y, up, N, res_ptr, sq_ptr,
    nw_ptr, xw_ptr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
    ADD_RES: tl.constexpr, WEIGHTED: tl.constexpr = False,
):  # fmt: skip
    """A program's float32 sums of its block of rows (and of their up rows) to y_ptr: at
    once with one split, else by the block's last split to arrive. bias: the rows' bias in
    float32 (row_bias), which a launch under PDL loads before its wait. ADD_RES: y_ptr gets
    the residual stream, sq_ptr the block's sum of squares, and with WEIGHTED xw_ptr the
    stream times the norm weight at nw_ptr (finish_rows)."""
    if SPLITS > 1:
        width = N
        if SILU_MUL:
            width = 2 * N
        if count_in(part_ptr, counts_ptr, block, split, rows, r_mask, y, up, N, width, SPLITS,
                    SILU_MUL):  # fmt: skip
            y, up = sum_splits(part_ptr, rows, r_mask, N, width, SPLITS, SILU_MUL)
            finish_rows(bias, y_ptr, rows, r_mask, y, up, res_ptr, sq_ptr, nw_ptr, xw_ptr,
                        block, HAS_BIAS, SILU_MUL, ADD_RES, WEIGHTED)  # fmt: skip
    else:
        finish_rows(bias, y_ptr, rows, r_mask, y, up, res_ptr, sq_ptr, nw_ptr, xw_ptr, block,
                    HAS_BIAS, SILU_MUL, ADD_RES, WEIGHTED)  # fmt: skip


@triton.jit
def row_bias(b_ptr, rows, r_mask, HAS_BIAS: tl.constexpr):
    """The rows' bias in float32 for finish_split (zeros without one)."""
    bias = tl.zeros(rows.shape, tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
    return bias


@triton.jit
def count_in(
    part_ptr, counts_ptr, block, split, rows, r_mask, y, up, N, width,
    SPLITS: tl.constexpr, SILU_MUL: tl.constexpr,
):  # fmt: skip
    """Stores this split's sums of the rows (and of their up rows); True in the block's last
    program to arrive."""
    at = part_ptr + split.to(tl.int64) * width + rows
    tl.store(at, y, mask=r_mask)
    if SILU_MUL:
        tl.store(at + N, up, mask=r_mask)
    return last_to_arrive(counts_ptr + block, SPLITS)


@triton.jit
def sum_splits(part_ptr, rows, r_mask, N, width, SPLITS: tl.constexpr, SILU_MUL: tl.constexpr):
    """Every split's sums of the rows (and their up rows), added in split order. Loads skip
    L1, which may hold an earlier launch's sums."""
    y = tl.zeros(rows.shape, tl.float32)
    up = y
    for s in tl.static_range(SPLITS):
        at = part_ptr + s * width + rows
        y += tl.load(at, mask=r_mask, other=0.0, cache_modifier=".cg")
        if SILU_MUL:
            up += tl.load(at + N, mask=r_mask, other=0.0, cache_modifier=".cg")
    return y, up


@triton.jit
def finish_rows(
    bias, y_ptr, rows, r_mask, y, up, res_ptr, sq_ptr, nw_ptr, xw_ptr, block,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, ADD_RES: tl.constexpr,
    WEIGHTED: tl.constexpr,
):  # fmt: skip
    """The float32 sums of the rows to y_ptr's dtype, with the bias, or silu(y) * up; with
    ADD_RES, plus the residual's rows, and the block's sum of squares of the result to
    sq_ptr[block]; with WEIGHTED too, the result times the norm weight's rows (nw_ptr),
    rounded, to xw_ptr: the next norm's output but for its 1 / RMS, which the product
    behind takes from the squares (quant_gemv_mma.py)."""
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    if HAS_BIAS:
        y += bias
    if SILU_MUL:
        # Both projections round to the model dtype first, as the unfused path's matmul does.
        y = _silu_mul(y.to(dtype), up.to(dtype), dtype)
    y = y.to(dtype)
    if ADD_RES:
        r = tl.load(res_ptr + rows, mask=r_mask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
        h = tl.where(r_mask, y.to(tl.float32), 0.0)  # rows past N may hold a copy of N - 1
        tl.store(sq_ptr + block, tl.sum(h * h, 0))
        if WEIGHTED:
            nw = tl.load(nw_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
            tl.store(xw_ptr + rows, (h * nw).to(dtype), mask=r_mask)
    tl.store(y_ptr + rows, y, mask=r_mask)


def split_columns(k: int, tile: int, splits: int) -> tuple[int, int]:
    """(columns a split, splits): whole tiles a split, and no split left empty."""
    chunk = triton.cdiv(triton.cdiv(k, tile), splits) * tile
    return chunk, triton.cdiv(k, chunk)
