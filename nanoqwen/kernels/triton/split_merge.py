"""Attention whose keys are split over programs (decode_attention.py, verify_attention.py),
merged in the same launch: each split stores its rows' partial output and log-sum-exp, then
counts itself in with an atomic add, and the last split of the group to arrive merges every
split's partials (no merge kernel of its own).

A row here is one (token, query head) pair; row_ids index the partials: part_out [rows,
NUM_SPLITS, HEAD_DIM] and part_lse [rows, NUM_SPLITS], float32. A split that saw none of a
row's keys stores lse -inf (weight 0); some split saw each real row's keys, so its largest
lse is finite.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanoqwen.kernels.triton.counters import last_to_arrive


@triton.jit
def store_split_and_merge(
    m_i, l_i, acc, part_out_ptr, part_lse_ptr, counter, out_rows, row_ids, r_mask, split,
    used, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    """Stores this split's partials (m_i, l_i, acc: the online softmax's state, base-2
    scores); the group's last split to arrive at `counter` (zero between launches, left
    zero) merges the `used` splits into out_rows."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    part = row_ids * NUM_SPLITS + split
    dv = tl.arange(0, HEAD_DIM)
    tl.store(part_lse_ptr + part, m_i + tl.log2(l_safe), mask=r_mask)
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dv[None, :], acc / l_safe[:, None],
             mask=r_mask[:, None])  # fmt: skip
    if last_to_arrive(counter, used):
        _merge(part_out_ptr, part_lse_ptr, out_rows, row_ids, r_mask, used, HEAD_DIM,
               NUM_SPLITS, SPLITS_PAD)  # fmt: skip


@triton.jit
def _merge(
    part_out_ptr, part_lse_ptr, out_rows, row_ids, r_mask, used,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    """The used splits' partial outputs, weighted by their mass. Loads skip L1, which may
    hold an earlier launch's partials."""
    s = tl.arange(0, SPLITS_PAD)
    part = row_ids[:, None] * NUM_SPLITS + s[None, :]
    live = r_mask[:, None] & (s < used)[None, :]
    lse = tl.load(part_lse_ptr + part, mask=live, other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # padding rows
    w = tl.exp2(lse - m[:, None])
    w = w / tl.where(r_mask, tl.sum(w, 1), 1.0)[:, None]
    dv = tl.arange(0, HEAD_DIM)
    out = tl.zeros([row_ids.shape[0], HEAD_DIM], tl.float32)
    rows = part_out_ptr + (row_ids * NUM_SPLITS)[:, None] * HEAD_DIM
    # Unrolled, every split's loads are in flight at once, where a loop issues them one
    # after another.
    for i in tl.static_range(NUM_SPLITS):
        if i < used:
            w_i = tl.sum(tl.where(s[None, :] == i, w, 0.0), 1)
            o = tl.load(rows + i * HEAD_DIM + dv[None, :], mask=r_mask[:, None], other=0.0,
                        cache_modifier=".cg")  # fmt: skip
            out += w_i[:, None] * o
    tl.store(out_rows, out.to(out_rows.dtype.element_ty), mask=r_mask[:, None])
