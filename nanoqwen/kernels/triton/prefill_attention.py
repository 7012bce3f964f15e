"""Paged prefill attention in Triton: variable-length query runs attending causally to their
sequence's cached context and to themselves, every key read through the block table.

Flash-attention style: each program owns one tile of one sequence's new tokens for one query
head and streams that sequence's keys in tiles with an online softmax. Keys before the tile's
first query are visible to every row and run without a mask; only the tiles that overlap the
tile's own tokens apply the causal mask. Tiles are issued last-first, so the longest programs
(the end of a long prompt) start before the short ones. GQA maps query head h to KV head
h // group; the K/V tiles of one KV head are shared by its group through L2.

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

# Tile shapes per head_dim: (query rows, keys per step, warps, pipeline stages). The bench
# (tools/prefill_bench.py --sweep) times the alternatives.
CONFIGS = {64: (128, 64, 4, 3), 128: (128, 64, 8, 3)}
DEFAULT_CONFIG = (64, 64, 4, 2)
LOG2_E = 1.4426950408889634


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
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr, cu_q_ptr, ctx_ptr,
    q_stride, table_stride, scale_log2,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 >= q_len:
        return
    ctx = tl.load(ctx_ptr + seq)
    cached = ctx - q_len  # keys in the cache before this step's tokens
    kvh = head // GROUP
    dtype: tl.constexpr = q_ptr.dtype.element_ty

    m = m0 + tl.arange(0, BLOCK_M)
    m_mask = m < q_len
    d = tl.arange(0, HEAD_DIM)
    rows = (q_start + m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * q_stride + head * HEAD_DIM + d[None, :],
        mask=m_mask[:, None],
        other=0.0,
    )
    q_pos = cached + m
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = tables_ptr + seq * table_stride
    offs_n = tl.arange(0, BLOCK_N)

    # Keys every row of the tile sees, in whole tiles: no mask.
    visible_end = (cached + m0) // BLOCK_N * BLOCK_N
    for n0 in range(0, visible_end, BLOCK_N):
        base = _key_offsets(table, n0, offs_n, kvh, NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, None)
        k = tl.load(k_cache_ptr + base[None, :] + d[:, None]).to(dtype)  # float8 widens
        s = tl.dot(q, k) * scale_log2
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + base[:, None] + d[None, :]).to(dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v)
        m_i = m_new

    # The rest, up to the tile's last query: causal mask (which also stops at the context).
    end = tl.minimum(ctx, cached + m0 + BLOCK_M)
    for n0 in range(visible_end, end, BLOCK_N):
        n = n0 + offs_n
        n_mask = n < end
        base = _key_offsets(table, n0, offs_n, kvh, NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, n_mask)
        k = tl.load(k_cache_ptr + base[None, :] + d[:, None], mask=n_mask[None, :], other=0.0)
        k = k.to(dtype)
        s = tl.dot(q, k) * scale_log2
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + base[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v.to(dtype))
        m_i = m_new

    # Every row saw key 0 at least, so l_i > 0; rows past the sequence's tokens are dropped.
    out = acc / l_i[:, None]
    dst = out_ptr + rows[:, None] * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def prefill_config(head_dim: int, max_seqlen_q: int) -> tuple[int, int, int, int]:
    """(query rows, keys per step, warps, stages); short query runs get a shorter tile."""
    block_m, block_n, warps, stages = CONFIGS.get(head_dim, DEFAULT_CONFIG)
    return min(block_m, max(16, triton.next_power_of_2(max_seqlen_q))), block_n, warps, stages


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
) -> torch.Tensor:
    """q: [tokens, heads, head_dim] with RoPE applied (rows may be strided, as views of qkv
    are); the rows of sequence i are cu_seqlens_q[i]:cu_seqlens_q[i+1], its last new tokens,
    whose K/V (rotated) are already in the cache along with the cached context before them:
    context_lens[i] keys in all. Returns [tokens, heads, head_dim] in q's dtype."""
    tokens, heads, head_dim = q.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim, "each row's heads must be contiguous"
    _, page, kv_heads, _ = k_cache.shape
    block_m, block_n, warps, stages = config or prefill_config(head_dim, max_seqlen_q)
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    seqs = cu_seqlens_q.shape[0] - 1
    grid = (triton.cdiv(max_seqlen_q, block_m), heads, seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens,
        q.stride(0), block_tables.stride(0), scale * LOG2_E,
        NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, GROUP=heads // kv_heads,
        PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
