"""Reference paged attention in plain torch: runs anywhere, defines what 'correct' means."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoqwen.attention.metadata import AttentionMetadata, split_qkv
from nanoqwen.attention.rotary import RotaryEmbedding, apply_rotary


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[seqs, max_blocks] block ids -> [seqs, kv_heads, max_blocks * block_size, head_dim]."""
    seqs, max_blocks = block_tables.shape
    _, block_size, kv_heads, head_dim = cache.shape
    # index_select, not cache[block_tables]: advanced indexing with an int32 index takes a
    # slow path on the CPU (~1 ms for one 64 KB block, against ~5 us here), twice per layer
    # in every decode step.
    flat = cache.index_select(0, block_tables.reshape(-1))
    return flat.view(seqs, max_blocks * block_size, kv_heads, head_dim).transpose(1, 2)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [seqs, heads, q_len, dim]; k/v: [seqs, kv_heads, k_len, dim] where key j sits at
    position j of its sequence. A query at position p sees keys 0..p, which is both the causal
    mask and the end of the valid context (p < context length)."""
    key_pos = torch.arange(k.shape[2], device=q.device)
    mask = key_pos.view(1, 1, 1, -1) <= q_positions.view(q.shape[0], 1, -1, 1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of q ([tokens, heads, dim], RoPE applied) over the paged cache."""
    if not meta.is_prefill:
        # One token per sequence: a single batched call over gathered blocks.
        k = gather_kv(k_cache, meta.block_tables)
        v = gather_kv(v_cache, meta.block_tables)
        mask = meta.shared.get("decode_mask")
        if mask is None:
            key_pos = torch.arange(k.shape[2], device=q.device)
            last = meta.context_lens.long() - 1
            mask = meta.shared["decode_mask"] = key_pos.view(1, 1, 1, -1) <= last.view(-1, 1, 1, 1)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        return out.squeeze(2)
    # Prefill lengths vary a lot; per sequence keeps memory at one score matrix.
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts = meta.cu_seqlens_q.tolist()
    ctx = meta.context_lens.tolist()
    for i in range(len(ctx)):
        s, e = starts[i], starts[i + 1]
        if s == e:  # a padded layout's sequence of no rows (runtime/prefill_graph.py)
            continue
        table = meta.block_tables[i : i + 1, : -(-ctx[i] // block_size)]
        k = gather_kv(k_cache, table)
        v = gather_kv(v_cache, table)
        qi = q[s:e].transpose(0, 1).unsqueeze(0)
        oi = attend(qi, k, v, meta.positions[s:e], scale)
        out[s:e] = oi.squeeze(0).transpose(0, 1)
    return out


class TorchAttention:
    name = "torch"

    def __init__(self, rotary: RotaryEmbedding, scale: float) -> None:
        self.rotary = rotary
        self.scale = scale

    def forward(self, qkv, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = split_qkv(qkv, k_cache)
        rope = meta.shared.get("rope")
        if rope is None or rope[0].dtype != q.dtype:
            rope = meta.shared["rope"] = self.rotary.cos_sin(meta.positions, q.dtype)
        cos, sin = rope
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta, self.scale)

    cascade_from = None
    captures_prefill = False  # no decode graphs either (graph_variants)

    def graph_variants(self, max_model_len: int) -> list[tuple[int, int]]:
        # Decode gathers every block-table column of every sequence; a graph captured for
        # the full model length would make that gigabytes per layer, so it stays eager.
        return []
