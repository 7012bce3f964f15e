"""flash-attn, with a Triton kernel for decode at small batch (kernels/decode_attention.py).

flash-attn's decode runs one thread block per (sequence, KV head), so below ~128 of those
most of the GPU idles while each block walks its whole context. The Triton kernel spreads
the context over up to 16 programs per KV head and also rotates and stores the new K/V in
the same launch: ~4-6 µs per layer against flash-attn's ~12 at batch 1 (BENCHMARKS.md).
From 128 (sequence, KV head) pairs up, one block per pair fills the GPU and flash-attn's
decode is as fast or up to 1.2x faster; prefill is always flash-attn's.
"""

from __future__ import annotations

import torch

from nanoqwen.kernels.decode_attention import decode_attention
from nanoqwen.runtime.attention.base import AttentionMetadata
from nanoqwen.runtime.attention.flash_backend import FlashAttention

TRITON_BELOW = 128  # (sequence, KV head) pairs per decode step


class TritonDecodeAttention(FlashAttention):
    name = "triton"

    def graph_variants(self, max_model_len: int) -> list[tuple[int, int]]:
        # Neither kernel's work depends on the table width here (flash-attn only serves
        # batches it splits once anyway): one graph per batch size.
        return [(max_model_len, 0)]

    def forward(self, qkv, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.is_prefill or qkv.shape[0] * k_cache.shape[2] >= TRITON_BELOW:
            return super().forward(qkv, k_cache, v_cache, meta)
        return decode_attention(
            qkv, meta.positions, meta.slot_mapping, meta.context_lens, meta.block_tables,
            self.rotary.cos_half, self.rotary.sin_half, k_cache, v_cache, self.scale,
            num_splits=meta.num_splits,
        )  # fmt: skip
