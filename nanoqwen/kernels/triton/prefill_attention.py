"""Paged prefill attention in Triton: variable-length query runs attending causally to their
sequence's cached context and to themselves, every key read through the block table.

Flash-attention style: a program owns one tile of one sequence's new tokens for one query
head and streams keys in tiles with an online softmax. Keys before the tile's first query are
visible to every row and run without a mask; only the tiles that overlap the tile's own
tokens apply the causal mask. Tiles are issued last-first, so the longest programs (the end of
a long prompt) start before the short ones. GQA maps query head h to KV head h // group; the
K/V tiles of one KV head are shared by its group through L2.

A chunk of a long prompt is a few query tiles over a long context: one program per (tile,
head) would leave most SMs idle while each walks the whole context. So the keys a tile sees
are split into up to NUM_SPLITS tile-aligned slices of at least MIN_SPLIT_KEYS keys, one
program each; a tile whose keys fill one slice writes its output directly, the others write
partial outputs that the merge kernel weighs by their softmax mass. The split count is fixed
per launch (a CUDA graph captures it) and the slices come from the live context. A sequence
with one new row (a running stream's token in a mixed step) is no query tile: the program of
its KV group's first head takes the group's heads as the rows of its dots, as decode does.

RoPE and the K/V write run before, in rope_and_store (kernels/triton/rope.py), and this kernel
reads every key, the new tokens' included, from the cache. Fusing them in was the other
choice and a worse one: a new token's key is read by every later query tile and by every head
of its group, so either every reader would rotate it again (4 products and roundings per key
element in every program, on CUDA cores beside the tensor-core dots) or readers would wait
for the program that writes it. rope_and_store reads and writes each token's q/k/v once, a
memory-bound pass over a few MB against a compute-bound attention that grows with the
square of the prompt (tools/prefill_bench.py times both). The decode kernel fuses them
because there each new key is read by one program only.

Any power-of-two block size works: a key tile that lies inside one block looks that block up
once, a tile that spans several small blocks looks up the block of each key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoqwen.kernels.triton.decode_attention import dot_rows, split_range
from nanoqwen.kernels.triton.split_merge import split_partials

# Tile shapes per head_dim: (query rows, keys per step, warps, pipeline stages). The bench
# (tools/prefill_bench.py --sweep) times the alternatives.
CONFIGS = {64: (128, 64, 4, 3), 128: (128, 64, 8, 3)}
DEFAULT_CONFIG = (64, 64, 4, 2)
LOG2_E = 1.4426950408889634
# Splitting a tile's keys pays from a few thousand keys on: below MIN_SPLIT_KEYS a tile runs
# in one program. Enough programs to fill the GPU: about two per SM of an H100/H200.
MIN_SPLIT_KEYS = 512
TARGET_PROGRAMS = 256
MAX_SPLITS = 16
# The merge takes a tile's rows MERGE_ROWS at a time: a [128, 128] float32 sum and its
# addresses spill.
MERGE_ROWS = 32


@triton.jit
def _key_offsets(
    table, n0, offs_n, kvh, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, mask,
):  # fmt: skip
    """Element offsets of keys n0 + offs_n of one KV head in the paged cache."""
    if PAGE >= BLOCK_N:
        # The tile lies inside one block: one table entry, contiguous rows.
        block = tl.load(table + n0 // PAGE).to(tl.int64)
        slot = block * PAGE + n0 % PAGE + offs_n
    else:
        n = n0 + offs_n
        block = tl.load(table + n // PAGE, mask=mask).to(tl.int64)  # masked keys: not read
        slot = block * PAGE + n % PAGE
    return (slot * NUM_KV_HEADS + kvh) * HEAD_DIM


@triton.jit
def _attend(
    q, acc, m_i, l_i, last, table, k_cache_ptr, v_cache_ptr, start, stop, kvh, scale_log2,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Online softmax of q's rows over keys [start, stop) of one KV head. Unmasked: whole
    tiles every row sees. Masked: row r sees keys up to last[r] and below stop; a row that
    has seen no key yet keeps m = -inf and l = 0."""
    dtype: tl.constexpr = q.dtype
    d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, stop, BLOCK_N):
        if MASKED:
            n = n0 + offs_n
            n_mask = n < stop
            base = _key_offsets(table, n0, offs_n, kvh, NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N,
                                n_mask)  # fmt: skip
            k = tl.load(k_cache_ptr + base[None, :] + d[:, None], mask=n_mask[None, :], other=0.0)
            s = tl.dot(q, k.to(dtype)) * scale_log2  # a float8 cache widens to q's dtype
            s = tl.where((n[None, :] <= last[:, None]) & n_mask[None, :], s, float("-inf"))
            v = tl.load(v_cache_ptr + base[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)
        else:
            base = _key_offsets(table, n0, offs_n, kvh, NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N,
                                None)  # fmt: skip
            k = tl.load(k_cache_ptr + base[None, :] + d[:, None])
            s = tl.dot(q, k.to(dtype)) * scale_log2
            v = tl.load(v_cache_ptr + base[:, None] + d[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Subtract 0 where a row has seen no key: exp2(-inf - -inf) would be NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v.to(dtype))
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_split(
    q, last, visible_end, table, k_cache_ptr, v_cache_ptr, start, stop, kvh, scale_log2,
    ROWS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Keys [start, stop): those below visible_end (tile-aligned, seen by every row) without
    a mask, the rest with the causal mask."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    acc, m_i, l_i = _attend(
        q, acc, m_i, l_i, last, table, k_cache_ptr, v_cache_ptr, start,
        tl.minimum(stop, visible_end), kvh, scale_log2,
        NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, False,
    )  # fmt: skip
    return _attend(
        q, acc, m_i, l_i, last, table, k_cache_ptr, v_cache_ptr,
        tl.maximum(start, visible_end), stop, kvh, scale_log2,
        NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, True,
    )  # fmt: skip


@triton.jit
def _finish(
    acc, m_i, l_i, index, row_mask, out_ptr, part_out_ptr, part_lse_ptr, split, used,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """The rows' output where one split holds all their keys; else their partial output
    and its log2-sum-exp (-inf for a row that saw no key), for the merge. index: the rows'
    (token * heads + head)."""
    d = tl.arange(0, HEAD_DIM)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if used == 1:
        dst = out_ptr + index[:, None] * HEAD_DIM + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        part = index * NUM_SPLITS + split
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_safe), mask=row_mask)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=row_mask[:, None])


@triton.jit
def _tile_keys(cu_q_ptr, ctx_ptr, seq, tile, BLOCK_M: tl.constexpr):
    """A query tile's sequence: its first row, its new rows, its context; and the end of the
    keys the tile's rows see, [0, end)."""
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    ctx = tl.load(ctx_ptr + seq)
    # Keys before this step's tokens are cached: ctx - q_len; the tile's last row sees up to
    # its own position.
    return q_start, q_len, ctx, tl.minimum(ctx, ctx - q_len + tile * BLOCK_M + BLOCK_M)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, tables_ptr,
    cu_q_ptr, ctx_ptr, q_stride, table_stride, scale_log2,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_KEYS: tl.constexpr,
):  # fmt: skip
    tile = tl.num_programs(0) // NUM_SPLITS - 1 - tl.program_id(0) // NUM_SPLITS
    split = tl.program_id(0) % NUM_SPLITS
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    q_start, q_len, ctx, end = _tile_keys(cu_q_ptr, ctx_ptr, seq, tile, BLOCK_M)
    m0 = tile * BLOCK_M
    if m0 >= q_len:
        return
    cached = ctx - q_len
    start, stop, used = split_range(end, split, NUM_SPLITS, BLOCK_N, MIN_KEYS)
    if split >= used:
        return
    kvh = head // GROUP
    table = tables_ptr + seq * table_stride
    d = tl.arange(0, HEAD_DIM)
    if q_len == 1:
        # A decoding sequence's one row: the program of the group's first head takes all the
        # group's heads as the rows of its dots (a query tile would be one row of BLOCK_M).
        if head % GROUP == 0:
            g = tl.arange(0, GROUP_PAD)
            g_mask = g < GROUP
            row = q_start.to(tl.int64)
            index = row * NUM_HEADS + head + g
            q = tl.load(q_ptr + row * q_stride + (head + g[:, None]) * HEAD_DIM + d[None, :],
                        mask=g_mask[:, None], other=0.0)  # fmt: skip
            last = ctx - 1 + tl.zeros([GROUP_PAD], tl.int32)
            acc, m_i, l_i = _attend_split(
                q, last, ctx // BLOCK_N * BLOCK_N, table, k_cache_ptr, v_cache_ptr, start, stop,
                kvh, scale_log2, GROUP_PAD, NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N,
            )  # fmt: skip
            _finish(acc, m_i, l_i, index, g_mask, out_ptr, part_out_ptr, part_lse_ptr, split,
                    used, HEAD_DIM, NUM_SPLITS)  # fmt: skip
    else:
        m = m0 + tl.arange(0, BLOCK_M)
        m_mask = m < q_len
        rows = (q_start + m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * q_stride + head * HEAD_DIM + d[None, :],
                    mask=m_mask[:, None], other=0.0)  # fmt: skip
        # Keys before the tile's first query are seen by every row: no mask in whole tiles.
        acc, m_i, l_i = _attend_split(
            q, cached + m, (cached + m0) // BLOCK_N * BLOCK_N, table, k_cache_ptr, v_cache_ptr,
            start, stop, kvh, scale_log2, BLOCK_M, NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N,
        )  # fmt: skip
        _finish(acc, m_i, l_i, rows * NUM_HEADS + head, m_mask, out_ptr, part_out_ptr,
                part_lse_ptr, split, used, HEAD_DIM, NUM_SPLITS)  # fmt: skip


@triton.jit
def _merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, cu_q_ptr, ctx_ptr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_KEYS: tl.constexpr,
    ROWS: tl.constexpr,
):  # fmt: skip
    """The partial outputs of a query tile's splits, each weighted by its softmax mass; a
    tile whose keys one split held has its output already."""
    tile = tl.program_id(0) // (BLOCK_M // ROWS)
    part_of_tile = tl.program_id(0) % (BLOCK_M // ROWS)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    q_start, q_len, _, end = _tile_keys(cu_q_ptr, ctx_ptr, seq, tile, BLOCK_M)
    m0 = tile * BLOCK_M + part_of_tile * ROWS
    if m0 >= q_len:
        return
    _, _, used = split_range(end, 0, NUM_SPLITS, BLOCK_N, MIN_KEYS)
    if used == 1:
        return
    m = m0 + tl.arange(0, ROWS)
    m_mask = m < q_len
    d = tl.arange(0, HEAD_DIM)
    part = ((q_start + m).to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS
    # Split 0 holds key 0, which every row sees: each row's maximum is finite.
    top = tl.full([ROWS], float("-inf"), tl.float32)
    for s in range(0, used):
        top = tl.maximum(top, tl.load(part_lse_ptr + part + s, mask=m_mask, other=float("-inf")))
    top = tl.where(m_mask, top, 0.0)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for s in range(0, used):
        w = tl.exp2(tl.load(part_lse_ptr + part + s, mask=m_mask, other=float("-inf")) - top)
        seen = m_mask & (w > 0)
        o = tl.load(part_out_ptr + (part + s)[:, None] * HEAD_DIM + d[None, :],
                    mask=seen[:, None], other=0.0)  # fmt: skip
        acc += w[:, None] * o
        total += w
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    dst = out_ptr + ((q_start + m).to(tl.int64) * NUM_HEADS + head)[:, None] * HEAD_DIM + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def prefill_config(head_dim: int, max_seqlen_q: int) -> tuple[int, int, int, int]:
    """(query rows, keys per step, warps, stages); short query runs get a shorter tile."""
    block_m, block_n, warps, stages = CONFIGS.get(head_dim, DEFAULT_CONFIG)
    return min(block_m, dot_rows(max_seqlen_q)), block_n, warps, stages


def num_splits_for(tiles: int, heads: int, max_seqlen_k: int) -> int:
    """Key splits per query tile: enough (tile, head) programs to fill the GPU once the
    context is long enough to split."""
    if max_seqlen_k <= MIN_SPLIT_KEYS:
        return 1
    most = min(MAX_SPLITS, triton.cdiv(max_seqlen_k, MIN_SPLIT_KEYS))
    return max(1, min(most, TARGET_PROGRAMS // (tiles * heads)))


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    config: tuple[int, int, int, int] | None = None,
    max_seqlen_k: int | None = None,
    num_splits: int = 0,
) -> torch.Tensor:
    """q: [tokens, heads, head_dim] with RoPE applied (rows may be strided, as views of qkv
    are); the rows of sequence i are cu_seqlens_q[i]:cu_seqlens_q[i+1], its last new tokens,
    whose K/V (rotated) are already in the cache along with the cached context before them:
    context_lens[i] keys in all, at most max_seqlen_k (None: no split). num_splits 0 picks
    the split count. Returns [tokens, heads, head_dim] in q's dtype."""
    tokens, heads, head_dim = q.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim, "each row's heads must be contiguous"
    _, page, kv_heads, _ = k_cache.shape
    block_m, block_n, warps, stages = config or prefill_config(head_dim, max_seqlen_q)
    tiles = triton.cdiv(max_seqlen_q, block_m)
    splits = num_splits or num_splits_for(tiles, heads, max_seqlen_k or 0)
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    part_out, part_lse = split_partials(out, splits)
    seqs = cu_seqlens_q.shape[0] - 1
    group = heads // kv_heads
    common = dict(NUM_HEADS=heads, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
                  NUM_SPLITS=splits, MIN_KEYS=max(MIN_SPLIT_KEYS, block_n))  # fmt: skip
    _prefill_kernel[(tiles * splits, heads, seqs)](
        q, k_cache, v_cache, out, part_out, part_lse, block_tables, cu_seqlens_q, context_lens,
        q.stride(0), block_tables.stride(0), scale * LOG2_E,
        NUM_KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=dot_rows(group),
        PAGE=page, num_warps=warps, num_stages=stages, **common,
    )  # fmt: skip
    if splits > 1:
        rows = min(MERGE_ROWS, block_m)
        _merge_kernel[(tiles * (block_m // rows), heads, seqs)](
            part_out, part_lse, out, cu_seqlens_q, context_lens, ROWS=rows, num_warps=4, **common
        )
    return out
