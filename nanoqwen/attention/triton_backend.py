"""Triton attention over the paged cache, at any block size, with flash-attn where it helps.

Prefill: rope_and_store (kernels/triton/rope.py) rotates q and writes the rotated K and V to their
slots, then the paged prefill kernel (kernels/triton/prefill_attention.py) attends over the cache,
which holds the cached context too. Decode: one launch of kernels/triton/decode_attention.py rotates
q and the new key, writes the new K/V and attends, each context split over up to 16 programs
per KV head (4 from 128 (sequence, KV head) pairs, 2 from 256, one from 512), the sequences
launched longest context first (the decode graphs pass that order). A speculative verify
step (the same few new rows in every sequence, AttentionMetadata.uniform_q) runs
rope_and_store, then kernels/triton/verify_attention.py, whose programs split the context as
decode does.

flash-attn is optional. Where it imports and fits (block size a multiple of 256), prefill
takes flash-attn's varlen forward (PREFILL_WITH_FLASH_ATTN; tools/prefill_bench.py measures the
two prefills side by side) and a shared-prefix decode its cascade. Plain decode stays on the
Triton kernel at every batch size: 1.8-4.5x faster than flash_attn_with_kvcache at small
batches, and 8-25% faster at 32-256 sequences of uneven length (BENCHMARKS.md).
"""

from __future__ import annotations

import torch

from nanoqwen.attention.metadata import AttentionMetadata, split_qkv
from nanoqwen.attention.rotary import RotaryEmbedding
from nanoqwen.kernels.triton.decode_attention import decode_attention
from nanoqwen.kernels.triton.prefill_attention import prefill_attention
from nanoqwen.kernels.triton.rope import rope_and_store
from nanoqwen.kernels.triton.verify_attention import verify_attention

PREFILL_WITH_FLASH_ATTN = True


class TritonAttention:
    name = "triton"

    def __init__(self, rotary: RotaryEmbedding, scale: float, use_flash_attn: bool) -> None:
        """use_flash_attn: flash-attn imports and fits this setup (flash_attn_problem)."""
        self.rotary = rotary
        self.scale = scale
        self.flash = None
        if use_flash_attn:
            from nanoqwen.attention.flash_backend import FlashAttention

            self.flash = FlashAttention(rotary, scale)

    def graph_variants(self, max_model_len: int) -> list[tuple[int, int]]:
        # The Triton kernels read only the live context, whatever the table width: one graph
        # per batch size.
        return [(max_model_len, 0)]

    captures_prefill = True  # with its own prefill kernel, never flash-attn's (flash_backend.py)

    @property
    def cascade_from(self) -> int | None:
        return None if self.flash is None else self.flash.cascade_from

    def forward(self, qkv, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.uniform_q:
            return self.verify(qkv, k_cache, v_cache, meta)
        if meta.is_prefill:
            if self.flash is not None and PREFILL_WITH_FLASH_ATTN and not meta.padded:
                return self.flash.forward(qkv, k_cache, v_cache, meta)
            return self.prefill(qkv, k_cache, v_cache, meta)
        if meta.prefix_len is not None:
            return self.flash.forward(qkv, k_cache, v_cache, meta)
        return decode_attention(
            qkv, meta.positions, meta.slot_mapping, meta.context_lens, meta.block_tables,
            self.rotary.cos_half, self.rotary.sin_half, k_cache, v_cache, self.scale,
            num_splits=meta.num_splits, order=meta.decode_order,
        )  # fmt: skip

    def _rotated_and_stored(self, qkv, k_cache, v_cache, meta: AttentionMetadata):
        """q rotated in place, the step's rotated keys and its values in their slots."""
        q, k, _ = split_qkv(qkv, k_cache)
        rope_and_store(
            q, k, meta.positions, self.rotary.cos_half, self.rotary.sin_half,
            meta.slot_mapping, k_cache, v_cache,
        )  # fmt: skip
        return q

    def verify(self, qkv, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        q = self._rotated_and_stored(qkv, k_cache, v_cache, meta)
        return verify_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.uniform_q, self.scale
        )

    def prefill(self, qkv, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        q = self._rotated_and_stored(qkv, k_cache, v_cache, meta)
        return prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
            meta.max_seqlen_q, self.scale, max_seqlen_k=meta.max_seqlen_k,
        )  # fmt: skip
