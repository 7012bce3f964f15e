"""Cascade decode: a prefix of KV blocks that every sequence of a decode batch shares is
attended once, for all the batch's queries together, and each sequence's own keys after it
separately; the two results merge by their log-sum-exps.

A batch of requests after one long system prompt or few-shot preamble (prefix caching makes
their first blocks the same physical blocks) otherwise reads those blocks once per sequence
and KV head each step: at 256 sequences over a shared 2,048-token prefix that is most of the
step's attention time. As one attention of bs query rows over the prefix, the blocks are
read once and the work runs on the tensor cores as a small GEMM.

Paged flash-attn does both parts (block sizes that are multiples of 256); the decode graphs
capture a cascade variant for batches of CASCADE_FROM sequences and up, and a step takes it
when shared_prefix_blocks finds at least one block.
"""

from __future__ import annotations

import numpy as np
import torch

# Below this many sequences a shared prefix is read by few programs and splitting pays little
# against the extra launches (two attention calls and a merge per layer).
CASCADE_FROM = 32


def shared_prefix_blocks(tables: np.ndarray, lens: np.ndarray, block_size: int) -> int:
    """Leading block-table columns that hold the same block for every sequence and lie
    wholly before each sequence's newest token (whose key this step writes)."""
    limit = int(lens.min() - 1) // block_size
    if limit == 0 or len(tables) < 2:
        return 0
    same = (tables[:, :limit] == tables[:1, :limit]).all(axis=0)
    return limit if bool(same.all()) else int(same.argmin())


def cascade_decode(q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
    """q: [seqs, heads, head_dim], already rotated; this step's K/V already in the cache.
    meta.block_tables[0]'s first meta.prefix_len keys are every sequence's; meta.suffix_tables
    and meta.suffix_lens give each sequence's keys after them."""
    from flash_attn import flash_attn_with_kvcache

    from nanoqwen.kernels.triton.merge_attention import merge_attention

    shared, shared_lse = flash_attn_with_kvcache(
        q.unsqueeze(0), k_cache, v_cache,
        cache_seqlens=meta.prefix_len, block_table=meta.block_tables[:1],
        softmax_scale=scale, causal=False, return_softmax_lse=True,
    )  # fmt: skip
    own, own_lse = flash_attn_with_kvcache(
        q.unsqueeze(1), k_cache, v_cache,
        cache_seqlens=meta.suffix_lens, block_table=meta.suffix_tables,
        softmax_scale=scale, causal=False, return_softmax_lse=True, num_splits=meta.num_splits,
    )  # fmt: skip
    # shared: [1, seqs, heads, d] with lse [1, heads, seqs]; own: [seqs, 1, heads, d], lse
    # [seqs, heads, 1].
    return merge_attention(shared[0], shared_lse[0].t(), own[:, 0], own_lse[:, :, 0])
