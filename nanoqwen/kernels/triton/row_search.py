"""The top-p threshold of a flat row, searched over the whole vocabulary by many programs.

sampling_thresholds._finish_row finds most thresholds among the vocabulary tiles'
candidates. A top-p boundary below every candidate (a flat row, whose nucleus holds tens of
thousands of tokens: what random weights give, and a trained model at a high temperature)
needs the row's probability mass at trial thresholds. A step's draw does without it
(nucleus_draw.py); the exact threshold serves Sampler.filtered_logits, the kept sets the
tests compare with the reference. A row is split over many programs: in each round (one
launch) every program measures PROBES trial thresholds over its slice, and the row's last
program to finish adds the slices' measures and narrows the row's key range PROBES-fold.
The rounds bring any range of float32 keys (2^32) down to one key, so the count of
launches is fixed; the programs of a row whose range is one key return at once, as do
those of rows that need no search.

The answer is _search's (sampling_thresholds.py): the largest v in [lo, hi) whose mass
sum(exp(x - m) for x >= max(v, bound)) reaches the target, lo when none does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoqwen.kernels.triton.counters import zeroed_counters
from nanoqwen.kernels.triton.select import from_ordered_key

# (trial keys a round, rounds, values a program loads at a time) by batch: at small batches
# a round costs its launch, so fewer rounds of more trial keys; at large ones the compares
# (every value against every trial key) are the cost, so more rounds of fewer.
SMALL_BATCH = 16
SMALL = (256, 4, 32)
LARGE = (16, 8, 256)
for _probes, _rounds, _ in (SMALL, LARGE):
    assert _probes**_rounds >= 2**32, "any range of float32 keys must come down to one key"
# Programs a round, over all rows.
TARGET_PROGRAMS = 1024


@triton.jit
def _round_kernel(
    z_ptr, vocab, keys_ptr, bound_ptr, m_ptr, target_ptr, partial_ptr, count_ptr, tau_ptr,
    parts, SLICE: tl.constexpr, PROBES: tl.constexpr, BLOCK: tl.constexpr,
    PARTS_BLOCK: tl.constexpr,
):  # fmt: skip
    """The mass at each trial key of the row's values in this program's slice; the row's
    last program adds them up and cuts the range [lo, hi) to the piece from the last trial
    key whose mass reaches the target to the next. A row whose range comes down to one key
    has its threshold, which joins its tau (the largest of top-k's, top-p's and min-p's)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    lo = tl.load(keys_ptr + row * 2)
    hi = tl.load(keys_ptr + row * 2 + 1)
    if hi - lo <= 1:
        return
    step = (hi - lo + PROBES - 1) // PROBES
    j = tl.arange(0, PROBES)
    keys = lo + j.to(tl.int64) * step
    probes = from_ordered_key(keys)
    bound = tl.load(bound_ptr + row)
    m = tl.load(m_ptr + row)
    z_row = z_ptr + row * vocab
    acc = tl.zeros([PROBES, BLOCK], dtype=tl.float32)
    for start in range(part * SLICE, part * SLICE + SLICE, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(z_row + offs, mask=offs < vocab, other=float("-inf"))
        x = tl.where(x >= bound, x, float("-inf"))
        keep = (x[None, :] >= probes[:, None]) & (x[None, :] > float("-inf"))
        acc += tl.where(keep, tl.exp(x - m)[None, :], 0.0)
    tl.store(partial_ptr + (row * parts + part) * PROBES + j, tl.sum(acc, 1))
    # Every thread's store, then one release-acquire count: the last program sees them all.
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == parts - 1:
        measure = tl.zeros([PROBES], dtype=tl.float32)
        for p0 in range(0, parts, PARTS_BLOCK):
            p = p0 + tl.arange(0, PARTS_BLOCK)
            at = partial_ptr + (row * parts + p[:, None]) * PROBES + j[None, :]
            measure += tl.sum(tl.load(at, mask=(p < parts)[:, None], other=0.0,
                                      cache_modifier=".cg"), 0)  # fmt: skip
        reached = (measure >= tl.load(target_ptr + row)) & (keys < hi)
        lo = tl.max(tl.where(reached, keys, lo), axis=0)
        hi = tl.minimum(lo + step, hi)
        tl.store(keys_ptr + row * 2, lo)
        tl.store(keys_ptr + row * 2 + 1, hi)
        tl.store(count_ptr + row, 0)
        if hi - lo <= 1:
            tau = tl.load(tau_ptr + row)
            tl.store(tau_ptr + row, tl.maximum(tau, from_ordered_key(lo)))


def search_rows(z: torch.Tensor, keys: torch.Tensor, bound, m, target, tau) -> None:
    """keys: [rows, 2] int64, each row's key range [lo, hi) as _finish_row left it (lo = hi
    where the row needs no search); bound (top-k's threshold), m (the row max), target (the
    mass to reach): [rows] float32. Raises tau where a row searched."""
    rows, vocab = z.shape
    probes, rounds, block = SMALL if rows <= SMALL_BATCH else LARGE
    slice_ = triton.cdiv(triton.cdiv(vocab, max(1, TARGET_PROGRAMS // rows)), 256) * 256
    parts = triton.cdiv(vocab, slice_)
    partial = torch.empty(rows, parts, probes, dtype=torch.float32, device=z.device)
    count = zeroed_counters(z.device, rows, "row search rows")
    for _ in range(rounds):
        _round_kernel[(rows, parts)](
            z, vocab, keys, bound, m, target, partial, count, tau, parts, SLICE=slice_,
            PROBES=probes, BLOCK=block, PARTS_BLOCK=64 if probes <= 64 else 8, num_warps=4,
        )  # fmt: skip
