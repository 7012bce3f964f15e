"""Paged decode attention in Triton: one token per sequence, the context split over many
programs so that even batch 1 keeps the GPU busy.

flash-attn's decode kernel gives each KV head of a sequence one thread block unless told a
split count, and it sizes that count from the block-table width, not from the context. Here
the split count is fixed per batch size (a CUDA graph captures it), while the keys each split
reads come from the live context length: split s of S takes the s-th of S equal, tile-aligned
slices of the cached keys (splits past a short context return at once). Programs start in
launch order with the sequence varying slowest, so an order that puts the longest contexts
first keeps the last wave from waiting on one long sequence.

The same kernel rotates q and the new key (HF's rounding, see rope._rotate), writes the
new key and value to their cache slot and attends to the new token straight from registers.
Only the last split holding keys owns the new token, so no program reads a slot another
program writes in the same launch. The splits' partial results merge in the same launch too:
each split counts itself in with an atomic add, and the last to arrive for its sequence and
KV head merges them (0.5B on the H200: 0.531 -> 0.526 ms a step at batch 1, 1.156 -> 1.140
at 64, against a merge kernel of its own).

Splits and tiles are tile-aligned and a tile divides a block, so each tile of keys lies in
one block and arrives as one bulk copy (TMA, a descriptor over the cache seen as rows of
tokens) that the compiler pipelines into shared memory. Key rows gathered by pointer were
not pipelined: each program waited on every tile's loads, with its registers holding them
(64 x 8K contexts at 0.5B: a float8 cache 77.8 -> 49.6 µs a layer, bfloat16 71.1 -> 68.6;
batch 1 at 32K: 36.2 -> 21.8). A float8 tile widens to float16, one instruction a pair.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from nanoqwen.kernels.triton.pdl import use_pdl
from nanoqwen.kernels.triton.rope import to_cache
from nanoqwen.kernels.triton.split_merge import (
    merge_chunk,
    split_buffers,
    store_split_and_merge,
)

# Tile (keys per inner step) and warps by (sequence, KV head) pairs, chosen with
# tools/kernel_bench.py on the H200 at 1 x 2K-32K, 64 x 8K and the throughput workload's
# U[100, 2048] at 64-256 sequences: below LARGE_BATCH pairs 128 keys over four warps (batch
# 1 at 32K: 22 / 39 µs a layer at 0.5B / 7B); up to XL_BATCH 64 keys on a warp per 64 of
# head_dim (7B, 64 x 8K: 244 µs against 272 for 128 on four); from there 128 keys on four
# (0.5B, 256 x U: 46 against 53). A float8 tile is converted before its dots, and 128 keys
# on a warp per 64 of head_dim do best at any large batch (0.5B, 64 x 8K: 50 µs against 81
# on four warps). A float8 cache of 128-wide heads from LARGE_BATCH to XL_BATCH pairs takes 64
# keys on one warp over four splits (7B, 64 x 8K on the H200: 144 µs a layer against 157 for
# 128 keys on two warps over two splits; 64 on one over two 161, over eight 155).
SMALL_TILE, SMALL_WARPS = 128, 4
LARGE_BATCH, LARGE_TILE = 128, 64
XL_BATCH, XL_TILE, XL_WARPS = 512, 128, 4
FP8_LARGE_TILE = 128
FP8_WIDE_TILE, FP8_WIDE_SPLITS = 64, 4
# Triton keeps one buffer of keys and one of values up to 4 stages: a tile's copy goes out
# after the dots of the one before, so the other programs on the SM hide its latency. Two
# buffers (5 stages) made 7B's 64 x 8K defaults slower, bfloat16 and float8 (BENCHMARKS.md).
NUM_STAGES = 2
MAX_SPLITS = 16
# Programs per launch worth filling at small batch: about two per SM of an H100/H200.
TARGET_PROGRAMS = 256


def _fp8_wide(pairs: int, head_dim: int, fp8: bool) -> bool:
    return fp8 and head_dim > 64 and LARGE_BATCH <= pairs < XL_BATCH


def tile_config(batch: int, num_kv_heads: int, head_dim: int, fp8: bool, page: int):
    """(keys a tile, warps a program); a tile never spans two blocks of the cache."""
    pairs = batch * num_kv_heads
    if pairs < LARGE_BATCH:
        tile, warps = SMALL_TILE, SMALL_WARPS
    elif _fp8_wide(pairs, head_dim, fp8):
        tile, warps = FP8_WIDE_TILE, 1
    elif fp8:
        tile, warps = FP8_LARGE_TILE, head_dim // 64
    elif pairs < XL_BATCH:
        tile, warps = LARGE_TILE, head_dim // 64
    else:
        tile, warps = XL_TILE, XL_WARPS
    return min(tile, page), warps


def num_splits_for(batch: int, num_kv_heads: int, head_dim: int = 0, fp8: bool = False) -> int:
    """Splits per (sequence, KV head): below LARGE_BATCH pairs enough programs to fill the
    GPU (at most 16); then 4, 2 from 256 pairs and 1 from 512 (a float8 cache of 128-wide
    heads: 4 up to 512)."""
    pairs = batch * num_kv_heads
    if _fp8_wide(pairs, head_dim, fp8):
        return FP8_WIDE_SPLITS
    if pairs >= 512:
        return 1
    if pairs >= 256:
        return 2
    if pairs >= LARGE_BATCH:
        return 4
    return max(1, min(MAX_SPLITS, TARGET_PROGRAMS // pairs))


def dot_rows(rows: int) -> int:
    """Rows padded to a power of two of at least 16, tl.dot's smallest M."""
    return max(16, triton.next_power_of_2(rows))


def decode_merge_chunk(
    pairs: int, group_pad: int, head_dim: int, warps: int, splits_pad: int
) -> int:
    """split_merge.merge_chunk for the decode kernel: a large batch's one-warp programs have
    half the registers to spare (0.5B batch 64 spilled 8 bytes at 64 a thread)."""
    registers = 64 if pairs < LARGE_BATCH else 32
    return merge_chunk(group_pad, head_dim, warps, splits_pad, registers)


@triton.jit
def split_range(
    cached, split, NUM_SPLITS: tl.constexpr, TILE_N: tl.constexpr, MIN_KEYS: tl.constexpr
):
    """Keys [start, end) of a split, of NUM_SPLITS equal, tile-aligned slices of the cached
    keys of at least MIN_KEYS keys (a multiple of TILE_N), and how many splits hold keys (at
    least one: in decode the last holds the new token)."""
    chunk = tl.maximum(tl.cdiv(tl.cdiv(cached, NUM_SPLITS), TILE_N) * TILE_N, MIN_KEYS)
    used = tl.maximum(tl.cdiv(cached, chunk), 1)
    start = split * chunk
    return start, tl.minimum(cached, start + chunk), used


@triton.jit
def _rotate_rows(x, x_swap, cos, sin, first, dtype: tl.constexpr):
    """rope._rotate over whole rows: x_swap holds each element's partner in the other half
    (rotate_half's source), first marks the first half, whose sine term is subtracted."""
    c = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
    s = (x_swap.to(tl.float32) * sin).to(dtype).to(tl.float32)
    return tl.where(first, c - s, c + s).to(dtype)


@triton.jit
def _tile_at(table, kvh, n0, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr):
    """Where keys [n0, n0 + tile) of one KV head lie in the cache seen as rows of tokens. A
    tile divides a page, so its rows are one bulk copy (TMA) from one block; rows past the
    context's end are read but never trusted (a slot never written, or written by an earlier
    request, may hold anything, NaN included)."""
    block = tl.load(table + n0 // PAGE)
    return [block * PAGE + n0 % PAGE, kvh * HEAD_DIM]


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, k_desc, v_desc, table, kvh, n0, end, scale_log2,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    at = _tile_at(table, kvh, n0, HEAD_DIM, PAGE)
    s = tl.dot(q, tl.trans(k_desc.load(at).to(q.dtype))) * scale_log2
    # The values' copy after the scores' dot keeps fewer registers live.
    return _accumulate(q, m_i, l_i, acc, s, v_desc.load(at), n0, end, TILE_N, MASKED)


@triton.jit
def _accumulate(q, m_i, l_i, acc, s, v, n0, end, TILE_N: tl.constexpr, MASKED: tl.constexpr):
    """The online softmax's step over one tile's scores s and values v, MASKED when the tile
    runs past the context's end."""
    v = v.to(q.dtype)
    if MASKED:
        n = n0 + tl.arange(0, TILE_N)
        s = tl.where((n < end)[None, :], s, float("-inf"))
        v = tl.where((n < end)[:, None], v, 0.0)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _new_token_rows(
    row, kvh, dv, partner, owns_new,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """The new token's key (and each element's rotate_half partner) and value from its qkv
    row; loaded only by the program that owns the new token."""
    k_row = row + (NUM_HEADS + kvh) * HEAD_DIM
    v_row = row + (NUM_HEADS + NUM_KV_HEADS + kvh) * HEAD_DIM
    mask = (dv < HEAD_DIM) & owns_new
    k_new = tl.load(k_row + dv, mask=mask, other=0.0)
    k_swap = tl.load(k_row + partner, mask=mask, other=0.0)
    return k_new, k_swap, tl.load(v_row + dv, mask=mask, other=0.0)


@triton.jit
def _decode_kernel(
    qkv_ptr, pos_ptr, slot_ptr, ctx_ptr, tables_ptr, order_ptr, cos_ptr, sin_ptr,
    k_cache_ptr, v_cache_ptr, k_desc, v_desc, out_ptr, part_out_ptr, part_lse_ptr, counts_ptr,
    qkv_stride, table_stride, scale_log2,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    PAGE: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr, MERGE_CHUNK: tl.constexpr, ORDERED: tl.constexpr,
    PRELOAD: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """counts_ptr: one int32 per (sequence, KV head), zero between launches: how many of its
    splits have stored their partial result."""
    if PDL:
        gdc_launch_dependents()
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    if ORDERED:
        seq = tl.load(order_ptr + seq).to(tl.int64)
    cached = tl.load(ctx_ptr + seq) - 1
    # A split takes one tile at least: at 4 tiles (so no merge below 512 keys) 0.5B batch 1
    # ran 0.611 ms a step against 0.556, one program walking the tiles of a short context.
    start, end, used = split_range(cached, split, NUM_SPLITS, TILE_N, TILE_N)
    if split >= used:
        return
    half: tl.constexpr = HEAD_DIM // 2
    dtype: tl.constexpr = qkv_ptr.dtype.element_ty
    # A float8 cache widens to float16 in one instruction per pair (to bfloat16 it takes
    # three); q fits float16's range and has more of its bits there.
    dot_dtype: tl.constexpr = tl.float16 if k_cache_ptr.dtype.element_ty.is_fp8() else dtype
    dv = tl.arange(0, HEAD_DIM)
    g = tl.arange(0, GROUP_PAD)
    g_mask = g < GROUP
    heads = kvh * GROUP + g

    # Whole rows: the rotation of both halves at once, so that each key is one contiguous
    # load and one dot over the head dimension.
    pos = tl.load(pos_ptr + seq)
    cos = tl.load(cos_ptr + pos * half + dv % half).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * half + dv % half).to(dtype).to(tl.float32)
    first = dv < half
    partner = (dv + half) % HEAD_DIM
    row = qkv_ptr + seq * qkv_stride
    q_offs = heads[:, None] * HEAD_DIM
    table = tables_ptr + seq * table_stride
    if PRELOAD:
        # The cache is this layer's own (the kernel in front never writes it), so the first
        # tile's copy can be in flight while that kernel finishes. Its block exists even
        # with no cached keys: the new token's slot is in it.
        at = _tile_at(table, kvh, start, HEAD_DIM, PAGE)
        k_first, v_first = k_desc.load(at), v_desc.load(at)
    owns_new = split == used - 1
    # (A float8 tile held from before the wait leaves no registers for them.)
    EARLY_NEW: tl.constexpr = PRELOAD and not k_cache_ptr.dtype.element_ty.is_fp8()
    if EARLY_NEW:
        slot = tl.load(slot_ptr + seq)  # a step input, not the kernel in front's output
    if PDL:
        gdc_wait()  # qkv is the kernel in front's output
    q = tl.load(row + q_offs + dv[None, :], mask=g_mask[:, None], other=0.0)
    q_swap = tl.load(row + q_offs + partner[None, :], mask=g_mask[:, None], other=0.0)
    if EARLY_NEW:
        # At small batch a program's path is one chain of waits: the new token's rows go out
        # with q's rather than after the tiles.
        k_new, k_swap, v_new = _new_token_rows(row, kvh, dv, partner, owns_new, NUM_HEADS,
                                               NUM_KV_HEADS, HEAD_DIM)  # fmt: skip
    q = _rotate_rows(q, q_swap, cos[None, :], sin[None, :], first[None, :], dtype)
    q = q.to(dot_dtype)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    # Tiles start tile-aligned, so only a context's last tile runs past it: the others skip
    # the masks.
    full_end = start + (end - start) // TILE_N * TILE_N
    loop_start = start
    if PRELOAD:
        if start < end:
            s = tl.dot(q, tl.trans(k_first.to(q.dtype))) * scale_log2
            m_i, l_i, acc = _accumulate(q, m_i, l_i, acc, s, v_first, start, end, TILE_N, True)
        loop_start += TILE_N
    for n0 in range(loop_start, full_end, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_desc, v_desc, table, kvh, n0, end, scale_log2,
            HEAD_DIM, PAGE, TILE_N, False,
        )  # fmt: skip
    # (Unless the preloaded first tile was that last one.)
    if full_end < end and (not PRELOAD or full_end > start):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_desc, v_desc, table, kvh, full_end, end, scale_log2,
            HEAD_DIM, PAGE, TILE_N, True,
        )  # fmt: skip

    if owns_new:
        # The step's own token: rotate and store its key, store its value, attend to both.
        if not EARLY_NEW:
            k_new, k_swap, v_new = _new_token_rows(row, kvh, dv, partner, True, NUM_HEADS,
                                                   NUM_KV_HEADS, HEAD_DIM)  # fmt: skip
            slot = tl.load(slot_ptr + seq)
        kn = _rotate_rows(k_new, k_swap, cos, sin, first, dtype)
        # As later steps will read it back from the cache.
        kn = to_cache(kn, k_cache_ptr)
        vn = to_cache(v_new, v_cache_ptr)
        dst = (slot * NUM_KV_HEADS + kvh) * HEAD_DIM
        tl.store(k_cache_ptr + dst + dv, kn)
        tl.store(v_cache_ptr + dst + dv, vn)
        s_new = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1) * scale_log2
        m_new = tl.maximum(m_i, s_new)
        alpha = tl.exp2(m_i - m_new)
        p_new = tl.exp2(s_new - m_new)
        l_i = l_i * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * vn.to(tl.float32)[None, :]
        m_i = m_new

    out_rows = out_ptr + seq * NUM_HEADS * HEAD_DIM + heads[:, None] * HEAD_DIM + dv[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_rows, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        if used == 1:
            tl.store(out_rows, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
                     mask=g_mask[:, None])  # fmt: skip
        else:
            store_split_and_merge(
                m_i, l_i, acc, part_out_ptr, part_lse_ptr,
                counts_ptr + seq * NUM_KV_HEADS + kvh, out_rows, seq * NUM_HEADS + heads,
                g_mask, split, used, HEAD_DIM, NUM_SPLITS, SPLITS_PAD, MERGE_CHUNK,
            )  # fmt: skip


def tile_reader(cache: torch.Tensor, tile: int) -> TensorDescriptor:
    """A bulk-copy (TMA) descriptor of a paged cache [blocks, page, kv_heads, head_dim] seen
    as rows of tokens, one KV head's tile of keys a copy."""
    blocks, page, kv_heads, head_dim = cache.shape
    rows = cache.view(blocks * page, kv_heads * head_dim)
    return TensorDescriptor.from_tensor(rows, [tile, head_dim])


def decode_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    cos_half: torch.Tensor,
    sin_half: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    num_splits: int = 0,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """qkv: [seqs, (heads + 2 * kv_heads) * head_dim], the projection of each sequence's new
    token. Writes the new k/v into the cache and returns the attention output
    [seqs, heads, head_dim]. num_splits 0 picks the count from the batch size. order: the
    sequences' launch order, a permutation of the rows (longest context first balances the
    last wave of programs)."""
    seqs = qkv.shape[0]
    _, page, kv_heads, head_dim = k_cache.shape
    num_heads = qkv.shape[1] // head_dim - 2 * kv_heads
    group = num_heads // kv_heads
    fp8 = k_cache.dtype.itemsize == 1
    splits = num_splits or num_splits_for(seqs, kv_heads, head_dim, fp8)
    tile, warps = tile_config(seqs, kv_heads, head_dim, fp8, page)
    pdl = use_pdl(qkv)
    # The first tile's copy before the wait pays at small batch (0.5B batch 1 on the H200,
    # two A/B pairs in one call: 0.593 -> 0.566 and 0.570 -> 0.544 ms a step); a large
    # batch's programs would hold it in registers they lack.
    preload = seqs * kv_heads < LARGE_BATCH and splits > 1
    group_pad = dot_rows(group)
    splits_pad = triton.next_power_of_2(splits)
    chunk = decode_merge_chunk(seqs * kv_heads, group_pad, head_dim, warps, splits_pad)
    out = torch.empty(seqs, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    part_out, part_lse, counts = split_buffers(
        out, splits, seqs * kv_heads, "decode attention splits"
    )
    _decode_kernel[(splits, kv_heads, seqs)](
        qkv, positions, slot_mapping, context_lens, block_tables,
        context_lens if order is None else order, cos_half, sin_half, k_cache, v_cache,
        tile_reader(k_cache, tile), tile_reader(v_cache, tile), out,
        part_out, part_lse, counts, qkv.stride(0), block_tables.stride(0),
        scale * 1.4426950408889634, NUM_HEADS=num_heads, NUM_KV_HEADS=kv_heads,
        HEAD_DIM=head_dim, GROUP=group, GROUP_PAD=group_pad, PAGE=page, TILE_N=tile,
        NUM_SPLITS=splits, SPLITS_PAD=splits_pad, MERGE_CHUNK=chunk,
        ORDERED=order is not None, PRELOAD=preload, PDL=pdl, launch_pdl=pdl, num_warps=warps,
        num_stages=NUM_STAGES,
    )  # fmt: skip
    return out
