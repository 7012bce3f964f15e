"""The CPU's bfloat16 attention: decode steps in one C call a layer (nanoqwen/native/
cpu_decode.c: RoPE, the KV write and attention over the paged cache, every sequence's KV
heads in parallel), where torch takes ~15 ops and 4-5x the time at short contexts; prefill
keeps the torch backend's ops."""

from __future__ import annotations

import torch

from nanoqwen.model.attention import AttentionMetadata
from nanoqwen.native.cpu_decode import decode_attention
from nanoqwen.runtime.attention.torch_backend import TorchAttention


class NativeAttention(TorchAttention):
    name = "native"

    def forward(self, qkv, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.is_prefill:
            return super().forward(qkv, k_cache, v_cache, meta)
        return decode_attention(
            qkv, meta.positions, meta.slot_mapping, meta.context_lens, meta.block_tables,
            self.rotary.cos_half, self.rotary.sin_half, k_cache, v_cache, self.scale,
        )  # fmt: skip
