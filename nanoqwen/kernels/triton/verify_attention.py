"""Paged attention for speculative verify steps in Triton: every sequence has the same few new
rows (its newest token and its k proposals), each attending to the cached context and
causally to the rows before it, the context split over many programs as in decode.

The prefill kernel gives each (query tile, head) one program that walks the whole context:
for a verify step of 5 rows that is 14 programs at 0.5B for the whole GPU, each latency
bound. Here a program owns one KV head of one sequence and one slice of its keys, with all
of the group's heads for all of the new rows as the rows of its dots (rows x group padded to
the next power of two), so the context is read once per KV head and split like decode
(decode_attention.num_splits_for); the last slice of a group to finish merges the slices'
partial softmaxes (split_merge.py).

rope_and_store (kernels/triton/rope.py) rotates q and writes the new K/V before, so every key,
the new rows' included, is read from the cache: new row j of a sequence of context length
ctx sits at position ctx - Q + j and sees the keys up to it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoqwen.kernels.triton.decode_attention import dot_rows, num_splits_for, split_range
from nanoqwen.kernels.triton.prefill_attention import LOG2_E, _key_offsets
from nanoqwen.kernels.triton.split_merge import (
    merge_chunk,
    split_buffers,
    store_split_and_merge,
)

TILE = 64  # keys per inner step


def verify_tile(rows: int, head_dim: int) -> tuple[int, int]:
    """A program's dot rows (its new rows times the group's heads, padded: dot_rows) and its
    warps."""
    padded = dot_rows(rows)
    return padded, 4 if padded * head_dim <= 64 * 64 else 8


@triton.jit
def _verify_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, ctx_ptr, tables_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    counts_ptr, q_stride, table_stride, scale_log2,
    Q: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, PAGE: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
):  # fmt: skip
    """counts_ptr: one int32 per (sequence, KV head), zero between launches: how many of its
    splits have stored their partial result (split_merge.py)."""
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    ctx = tl.load(ctx_ptr + seq)
    # The new rows' keys are in the cache already: all ctx keys are split alike.
    start, end, used = split_range(ctx, split, NUM_SPLITS, TILE_N, TILE_N)
    if split >= used:
        return
    dtype: tl.constexpr = q_ptr.dtype.element_ty
    d = tl.arange(0, HEAD_DIM)
    r = tl.arange(0, ROWS)
    j = r // GROUP  # the new row (token) of each dot row
    head = kvh * GROUP + r % GROUP
    r_mask = r < Q * GROUP
    token = seq * Q + j
    q = tl.load(
        q_ptr + token[:, None] * q_stride + head[:, None] * HEAD_DIM + d[None, :],
        mask=r_mask[:, None],
        other=0.0,
    )
    last = ctx - Q + j  # each row's own position: the last key it sees

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    table = tables_ptr + seq * table_stride
    offs_n = tl.arange(0, TILE_N)
    for n0 in range(start, end, TILE_N):
        n = n0 + offs_n
        n_mask = n < end
        base = _key_offsets(table, n0, offs_n, kvh, NUM_KV_HEADS, HEAD_DIM, PAGE, TILE_N, n_mask)
        # A float8 cache's keys and values widen to q's dtype for the dots.
        k = tl.load(k_cache_ptr + base[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(dtype)))
        seen = n_mask[None, :] & (n[None, :] <= last[:, None])
        s = tl.where(seen, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf: subtract 0 instead, so that
        # exp2(-inf - -inf) never makes a NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + base[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v.to(dtype))
        m_i = m_new

    out_rows = out_ptr + (token[:, None] * NUM_HEADS + head[:, None]) * HEAD_DIM + d[None, :]
    if NUM_SPLITS == 1 or used == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None])
    else:
        store_split_and_merge(
            m_i, l_i, acc, part_out_ptr, part_lse_ptr, counts_ptr + seq * NUM_KV_HEADS + kvh,
            out_rows, token * NUM_HEADS + head, r_mask, split, used, HEAD_DIM, NUM_SPLITS,
            SPLITS_PAD, MERGE_CHUNK,
        )  # fmt: skip


def verify_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    rows_per_seq: int,
    scale: float,
    num_splits: int = 0,
) -> torch.Tensor:
    """q: [seqs * rows_per_seq, heads, head_dim] with RoPE applied, sequence by sequence;
    their K/V are in the cache already, the last rows_per_seq of each sequence's
    context_lens keys. Returns [tokens, heads, head_dim] in q's dtype."""
    tokens, heads, head_dim = q.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim, "each row's heads must be contiguous"
    _, page, kv_heads, _ = k_cache.shape
    seqs = tokens // rows_per_seq
    group = heads // kv_heads
    splits = num_splits or num_splits_for(seqs, kv_heads)
    rows, warps = verify_tile(rows_per_seq * group, head_dim)
    splits_pad = triton.next_power_of_2(splits)
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    part_out, part_lse, counts = split_buffers(
        out, splits, seqs * kv_heads, "verify attention splits"
    )
    _verify_kernel[(splits, kv_heads, seqs)](
        q, k_cache, v_cache, context_lens, block_tables, out, part_out, part_lse, counts,
        q.stride(0), block_tables.stride(0), scale * LOG2_E,
        Q=rows_per_seq, NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, GROUP=group,
        ROWS=rows, PAGE=page, TILE_N=TILE, NUM_SPLITS=splits,
        SPLITS_PAD=splits_pad, MERGE_CHUNK=merge_chunk(rows, head_dim, warps, splits_pad),
        num_warps=warps, num_stages=2,
    )  # fmt: skip
    return out
