"""The CPU's bfloat16 attention (nanoqwen/kernels/cpu/cpu_ops.c): a decode step in one C call a
layer (RoPE, the KV write and attention over the paged cache, every sequence's KV heads in
parallel), where torch takes ~15 ops and 4-5x the time at short contexts; a prefill rotates
and writes in C, bit for bit torch's, then attends as the torch backend does."""

from __future__ import annotations

import torch

from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.attention.torch_backend import TorchAttention, paged_attention
from nanoqwen.kernels.cpu.cpu_ops import decode_attention, rope_and_store


class NativeAttention(TorchAttention):
    name = "native"

    def forward(self, qkv, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.is_prefill:
            q = rope_and_store(
                qkv, meta.positions, meta.slot_mapping, self.rotary.cos_half,
                self.rotary.sin_half, k_cache, v_cache,
            )  # fmt: skip
            return paged_attention(q, k_cache, v_cache, meta, self.scale)
        return decode_attention(
            qkv, meta.positions, meta.slot_mapping, meta.context_lens, meta.block_tables,
            self.rotary.cos_half, self.rotary.sin_half, k_cache, v_cache, self.scale,
        )  # fmt: skip
