"""Attention whose keys are split over programs (decode_attention.py, verify_attention.py),
merged in the same launch: each split stores its rows' partial output and log-sum-exp, then
counts itself in with an atomic add, and the last split of the group to arrive merges every
split's partials (no merge kernel of its own).

A row here is one (token, query head) pair; row_ids index the partials: part_out [rows,
NUM_SPLITS, HEAD_DIM] and part_lse [rows, NUM_SPLITS], float32. A split that saw none of a
row's keys stores lse -inf (weight 0); some split saw each real row's keys, so its largest
lse is finite.

The merge loads its splits' partials a chunk at a time (merge_chunk), the first chunk along
with the log-sum-exps, so that the usual merge is one trip to memory after the count: against
one load a split, 0.5B batch 1 ran 0.560 -> 0.556 ms a step at a 128-token prompt and 0.974
-> 0.907 at 16K (H100, 2026-12-06).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoqwen.kernels.triton.counters import last_to_arrive, zeroed_counters


def merge_chunk(rows: int, head_dim: int, warps: int, splits_pad: int, registers: int = 64) -> int:
    """Splits whose partial outputs the merge loads at once: the most (a power of two, at most
    splits_pad) whose [rows, chunk, head_dim] float32 tile takes at most `registers` a
    thread. A load a split would cost a trip to memory a split (sm_90 SASS)."""
    chunk = 1
    while chunk < splits_pad and rows * 2 * chunk * head_dim <= registers * 32 * warps:
        chunk *= 2
    return chunk


def split_partials(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """part_out [tokens, heads, splits, head_dim] and part_lse [tokens, heads, splits],
    float32, for an output out [tokens, heads, head_dim]; with one split nothing is merged,
    and out stands in for both."""
    if splits == 1:
        return out, out
    tokens, heads, head_dim = out.shape
    f32 = dict(dtype=torch.float32, device=out.device)
    part_out = torch.empty(tokens, heads, splits, head_dim, **f32)
    part_lse = torch.empty(tokens, heads, splits, **f32)
    return part_out, part_lse


def split_buffers(
    out: torch.Tensor, splits: int, groups: int, user: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """split_partials and the arrival counters of a merge in the same launch (one a group of
    rows merged together); with one split out stands in for the three."""
    part_out, part_lse = split_partials(out, splits)
    counts = zeroed_counters(out.device, groups, user) if splits > 1 else out
    return part_out, part_lse, counts


@triton.jit
def store_split_and_merge(
    m_i, l_i, acc, part_out_ptr, part_lse_ptr, counter, out_rows, row_ids, r_mask, split,
    used, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """Stores this split's partials (m_i, l_i, acc: the online softmax's state, base-2
    scores); the group's last split to arrive at `counter` (zero between launches, left
    zero) merges the `used` splits into out_rows, CHUNK splits a load."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    part = row_ids * NUM_SPLITS + split
    dv = tl.arange(0, HEAD_DIM)
    tl.store(part_lse_ptr + part, m_i + tl.log2(l_safe), mask=r_mask)
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dv[None, :], acc / l_safe[:, None],
             mask=r_mask[:, None])  # fmt: skip
    if last_to_arrive(counter, used):
        _merge(part_out_ptr, part_lse_ptr, out_rows, row_ids, r_mask, used, HEAD_DIM,
               NUM_SPLITS, SPLITS_PAD, CHUNK)  # fmt: skip


@triton.jit
def _merge(
    part_out_ptr, part_lse_ptr, out_rows, row_ids, r_mask, used,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """The used splits' partial outputs, weighted by their mass. The first chunk's loads go
    out with the log-sum-exps that weigh it, so that a merge of at most CHUNK splits is one
    trip to memory; the loads of a later chunk wait on a branch. Loads skip L1, which may
    hold an earlier launch's partials."""
    s = tl.arange(0, SPLITS_PAD)
    live = r_mask[:, None] & (s < used)[None, :]
    lse = tl.load(part_lse_ptr + row_ids[:, None] * NUM_SPLITS + s[None, :], mask=live,
                  other=float("-inf"), cache_modifier=".cg")  # fmt: skip
    # The first chunk's log-sum-exps load again beside its outputs, in the same trip, rather
    # than being picked out of `lse`'s registers.
    lse_c, o = _load_chunk(part_out_ptr, part_lse_ptr, row_ids, r_mask, used, 0, HEAD_DIM,
                           NUM_SPLITS, CHUNK)  # fmt: skip
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # padding rows
    total = tl.where(r_mask, tl.sum(tl.exp2(lse - m[:, None]), 1), 1.0)
    out = tl.sum((tl.exp2(lse_c - m[:, None]) / total[:, None])[:, :, None] * o, 1)
    for first in tl.static_range(CHUNK, NUM_SPLITS, CHUNK):
        if first < used:
            lse_c, o = _load_chunk(part_out_ptr, part_lse_ptr, row_ids, r_mask, used, first,
                                   HEAD_DIM, NUM_SPLITS, CHUNK)  # fmt: skip
            out += tl.sum((tl.exp2(lse_c - m[:, None]) / total[:, None])[:, :, None] * o, 1)
    tl.store(out_rows, out.to(out_rows.dtype.element_ty), mask=r_mask[:, None])


@triton.jit
def _load_chunk(
    part_out_ptr, part_lse_ptr, row_ids, r_mask, used, first,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Splits [first, first + CHUNK)'s log-sum-exps [rows, CHUNK] and partial outputs [rows,
    CHUNK, HEAD_DIM]; those past `used` weigh nothing (-inf) and hold zeros."""
    c = first + tl.arange(0, CHUNK)
    part = row_ids[:, None] * NUM_SPLITS + c[None, :]
    live = r_mask[:, None] & (c < used)[None, :]
    lse = tl.load(part_lse_ptr + part, mask=live, other=float("-inf"), cache_modifier=".cg")
    dv = tl.arange(0, HEAD_DIM)
    o = tl.load(part_out_ptr + part[:, :, None] * HEAD_DIM + dv[None, None, :],
                mask=live[:, :, None], other=0.0, cache_modifier=".cg")  # fmt: skip
    return lse, o
