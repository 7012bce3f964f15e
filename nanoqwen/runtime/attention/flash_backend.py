"""flash-attn over the paged KV cache, RoPE fused.

Decode: one flash_attn_with_kvcache call rotates q and the new k (rotary_cos/sin at each
sequence's position), appends k/v into the paged cache and attends.
Prefill: a Triton kernel rotates q/k and writes k/v to their slots in one pass, then
flash_attn_varlen_func attends over the paged cache, so cached context is seen too.
"""

from __future__ import annotations

import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from nanoqwen.kernels.rope import rope_and_store
from nanoqwen.model.attention import AttentionMetadata, split_qkv
from nanoqwen.model.layers import RotaryEmbedding
from nanoqwen.runtime.attention.cascade import CASCADE_FROM, cascade_decode

# Decode graphs for contexts up to here use a narrow block table and one KV split.
# flash-attn sizes its split count from the table width, so a graph captured for the full
# model length splits even a 100-token context 60 ways and spends most of a small decode
# step merging the splits.
SHORT_CONTEXT = 2048


class FlashAttention:
    name = "flash-attn"

    def __init__(self, rotary: RotaryEmbedding, scale: float) -> None:
        self.rotary = rotary
        self.scale = scale
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def _rotary_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # flash-attn wants cos/sin in the activation dtype; build once, not per call.
        if dtype not in self._tables:
            self._tables[dtype] = (
                self.rotary.cos_half.to(dtype).contiguous(),
                self.rotary.sin_half.to(dtype).contiguous(),
            )
        return self._tables[dtype]

    def graph_variants(self, max_model_len: int) -> list[tuple[int, int]]:
        if max_model_len <= SHORT_CONTEXT:
            return [(max_model_len, 1)]
        return [(SHORT_CONTEXT, 1), (max_model_len, 0)]

    cascade_from = CASCADE_FROM

    def forward(self, qkv, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = split_qkv(qkv, k_cache)
        if meta.is_prefill:
            return self.prefill(q, k, k_cache, v_cache, meta)
        if meta.prefix_len is not None:
            rope_and_store(
                q, k, meta.positions, self.rotary.cos_half, self.rotary.sin_half,
                meta.slot_mapping, k_cache, v_cache,
            )  # fmt: skip
            return cascade_decode(q, k_cache, v_cache, meta, self.scale)
        return self.decode(q, k, v, k_cache, v_cache, meta)

    def prefill(self, q, k, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """RoPE and the K/V write in one kernel, then attention over the paged cache (which
        holds any cached context of the sequences too)."""
        rope_and_store(
            q, k, meta.positions, self.rotary.cos_half, self.rotary.sin_half,
            meta.slot_mapping, k_cache, v_cache,
        )  # fmt: skip
        return flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=self.scale,
            causal=True,
            block_table=meta.block_tables,
        )

    def decode(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        cos, sin = self._rotary_tables(q.dtype)
        out = flash_attn_with_kvcache(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            k=k.unsqueeze(1),
            v=v.unsqueeze(1),
            rotary_cos=cos,
            rotary_sin=sin,
            cache_seqlens=meta.cache_seqlens,
            block_table=meta.block_tables,
            softmax_scale=self.scale,
            causal=True,
            rotary_interleaved=False,
            num_splits=meta.num_splits,
        )
        return out.squeeze(1)
