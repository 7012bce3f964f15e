"""flash-attn over the paged KV cache, RoPE fused.

Both phases: a Triton kernel rotates q/k and writes k/v to their slots in one pass, then
flash-attn attends over the paged cache (its varlen forward in prefill, so cached context
is seen too; flash_attn_with_kvcache in decode).
"""

from __future__ import annotations

import torch
from flash_attn import flash_attn_with_kvcache
from flash_attn.flash_attn_interface import flash_attn_gpu  # the C++ ops under the wrappers

from nanoqwen.attention.cascade import CASCADE_FROM, cascade_decode
from nanoqwen.attention.metadata import AttentionMetadata, split_qkv
from nanoqwen.attention.rotary import RotaryEmbedding
from nanoqwen.kernels.triton.rope import rope_and_store

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

    def graph_variants(self, max_model_len: int) -> list[tuple[int, int]]:
        if max_model_len <= SHORT_CONTEXT:
            return [(max_model_len, 1)]
        return [(SHORT_CONTEXT, 1), (max_model_len, 0)]

    cascade_from = CASCADE_FROM
    # Its varlen forward is captured over the prefill graphs' padded layout
    # (prefill_graph.py); each bucket's capture warm-up must run over that bucket's own
    # layout, since the largest bucket's reads past the end of a smaller bucket's tensors
    # and writes NaN into the KV cache. A graph's max_seqlen_k is the model's length, so
    # flash-attn may split the keys where the eager step does not: the same logits to bf16
    # rounding, not bit for bit.
    captures_prefill = True

    def forward(self, qkv, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, _ = split_qkv(qkv, k_cache)
        # Not flash_attn_with_kvcache's own rotary and K/V append in decode: profiled over
        # the 7B throughput workload, its calls with them take 119 µs each against 90 µs
        # without them (tools/profile_workload.py).
        rope_and_store(
            q, k, meta.positions, self.rotary.cos_half, self.rotary.sin_half,
            meta.slot_mapping, k_cache, v_cache,
        )  # fmt: skip
        if meta.is_prefill:
            return varlen_attention(q, k_cache, v_cache, meta, self.scale)
        if meta.prefix_len is not None:
            return cascade_decode(q, k_cache, v_cache, meta, self.scale)
        out = flash_attn_with_kvcache(
            q.unsqueeze(1), k_cache, v_cache,
            cache_seqlens=meta.context_lens, block_table=meta.block_tables,
            softmax_scale=self.scale, causal=True, num_splits=meta.num_splits,
        )  # fmt: skip
        return out.squeeze(1)


def varlen_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """What flash_attn_varlen_func(..., causal=True, block_table=...) returns, from its C++
    op: the autograd Function and torch custom-op layers around it took ~70 of its ~85 µs
    of CPU a call, ~2 ms of a 128-token prefill's 10 (eager, CPU-bound). q's last dimension
    is contiguous (split_qkv), as the op requires."""
    out, *_ = flash_attn_gpu.varlen_fwd(
        q, k_cache, v_cache, None, meta.cu_seqlens_q, meta.cu_seqlens_k,
        None, None, meta.block_tables, None,  # seqused_k, leftpad_k, block table, alibi
        meta.max_seqlen_q, meta.max_seqlen_k, 0.0, scale,  # dropout, softmax scale
        False, True, -1, -1, 0.0, False, None,  # zero_tensors, causal, window, softcap, ...
    )  # fmt: skip
    return out
