"""The largest values of a block without sorting it, for the sampler's candidates.

store_above: the values above a floor that leaves at most k, for each vocabulary tile and
for the merge of the tiles' candidates. Exactly the k largest took a bisection on the float
order, 32 block-wide reductions: more than tl.topk itself on a tile (H200, 2026-12-01), and
20.5 µs a step on the merge's ~4,800 values in one program (2026-12-04).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ordered_key(x):
    """float32 -> int64 key with the same order (negative floats' bits reversed)."""
    i = x.to(tl.int32, bitcast=True)
    return tl.where(i < 0, i ^ 0x7FFFFFFF, i).to(tl.int64)


@triton.jit
def from_ordered_key(key):
    i = key.to(tl.int32)
    return tl.where(i < 0, i ^ 0x7FFFFFFF, i).to(tl.float32, bitcast=True)


@triton.jit
def _store_compacted(x, keep, fill, out_ptr, K: tl.constexpr):
    """x's kept values at out_ptr[:count] in x's order, fill in the rest of out_ptr[:K]."""
    tl.store(out_ptr + tl.cumsum(keep.to(tl.int32), axis=0) - 1, x, mask=keep)
    idx = tl.arange(0, K)
    tl.store(out_ptr + idx, fill, mask=idx >= tl.sum(keep.to(tl.int32), axis=0))


@triton.jit
def _count_above(x, probes):
    return tl.sum((x[None, :] > probes[:, None]).to(tl.int32), axis=1)


@triton.jit
def store_above(x, top, out_ptr, K: tl.constexpr, lowest=float("-inf")):
    """Stores every value of the 1-D block x above a floor that leaves at most K of them at
    out_ptr[:K] (in no order, -inf after them) and returns the floor: never below lowest
    (fewer values kept where they would not matter), lowest itself where that leaves at most
    K, else close to x's K-th largest, not exactly it, for a fraction of a sort's work. top:
    x's max. Two rounds of 16 probes, each one batched count: first gaps below top from 0 to
    64 (ratio ~1.5), then 16 even steps inside the bracket where the count passes K."""
    if tl.sum((x > lowest).to(tl.int32), axis=0) <= K:
        floor = tl.zeros((), tl.float32) + lowest
    else:
        j = tl.arange(0, 16)
        gaps = tl.where(j == 0, 0.0, tl.exp2(j.to(tl.float32) * 0.6 - 3.0))
        probes = top - gaps  # decreasing: counts increase
        fits = _count_above(x, probes) <= K  # true at j = 0: nothing is above the max
        last = tl.max(tl.where(fits, j, 0), axis=0)
        hi = tl.sum(tl.where(j == last, probes, 0.0), axis=0)
        lo = tl.sum(tl.where(j == tl.minimum(last + 1, 15), probes, 0.0), axis=0)
        span = tl.where(hi > lo, hi - lo, 0.0)  # 0 for an all -inf block (inf - inf is nan)
        probes = hi - span * (j.to(tl.float32) / 16.0)
        fits = _count_above(x, probes) <= K
        floor = tl.maximum(tl.min(tl.where(fits, probes, hi), axis=0), lowest)
    _store_compacted(x, x > floor, float("-inf"), out_ptr, K)
    return floor
