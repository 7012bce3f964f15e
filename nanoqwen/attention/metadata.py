"""The contract between the model and an attention backend: what the model hands a backend
each step (AttentionMetadata) and what it calls (AttentionBackend). The backends live in
nanoqwen/attention/backends/."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Per-step description of a flat token batch drawn from many sequences.

    Tokens of sequence i occupy rows cu_seqlens_q[i]:cu_seqlens_q[i+1] of the batch; in decode
    every sequence contributes exactly one token. context_lens counts the tokens of each
    sequence that are in the KV cache once this step has written its own.
    """

    is_prefill: bool
    positions: torch.Tensor  # [tokens] int64
    slot_mapping: torch.Tensor  # [tokens] int64, cache slot = block * block_size + offset
    context_lens: torch.Tensor  # [seqs] int32
    block_tables: torch.Tensor  # [seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [seqs + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    # Prefill only: key offsets over the cached context of each sequence.
    cu_seqlens_k: torch.Tensor | None = None
    # Decode only: KV splits per sequence and KV head; 0 lets the backend choose.
    num_splits: int = 0
    # Decode only: a permutation of the rows, longest context first, for backends that
    # launch work per sequence (the Triton decode kernel); None: batch order.
    decode_order: torch.Tensor | None = None  # [seqs] int32
    # Decode only, cascade (attention/cascade.py): the first prefix_len[0] keys of every
    # sequence are block_tables[0]'s; suffix_tables / suffix_lens hold each one's keys after.
    prefix_len: torch.Tensor | None = None  # [1] int32
    suffix_tables: torch.Tensor | None = None  # [seqs, max_blocks] int32
    suffix_lens: torch.Tensor | None = None  # [seqs] int32
    # Prefill graphs (runtime/prefill_graph.py): the last sequence is padding rows, and the
    # step is captured, so only kernels the backend's captures_prefill vouches for may run.
    padded: bool = False
    # Verify steps (runtime/spec/verify_graph.py): every sequence has exactly this many new
    # rows, the last of its context_lens keys, which backends with a kernel for the shape use
    # (kernels/triton/verify_attention.py); 0 otherwise.
    uniform_q: int = 0
    # What every layer of the step would compute alike (RoPE rows, the decode mask): the
    # first layer stores it, the others reuse it. On the CPU each small op costs ~10 us.
    shared: dict = field(default_factory=dict, repr=False)


class AttentionBackend(Protocol):
    """Applies RoPE, writes the step's K/V into the paged cache, and attends.

    qkv: [tokens, (heads + 2 * kv_heads) * head_dim], the qkv projection of each token, q
    columns first, then k, then v, before RoPE.
    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim].
    Returns [tokens, heads, head_dim].
    """

    name: str

    def forward(
        self,
        qkv: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...

    def graph_variants(self, max_model_len: int) -> list[tuple[int, int]]:
        """The decode graphs to capture per batch size, as (longest context served, KV split
        count for AttentionMetadata.num_splits), shortest first."""
        ...

    @property
    def cascade_from(self) -> int | None:
        """The smallest decode batch that takes cascade metadata (prefix_len set), or None
        where the backend has no cascade decode."""
        ...

    # Whether prefill steps may be captured in CUDA graphs (metadata with padded=True).
    captures_prefill: bool


def split_qkv(
    qkv: torch.Tensor, k_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of q [tokens, heads, dim] and k, v [tokens, kv_heads, dim] over qkv's columns."""
    kv_heads, head_dim = k_cache.shape[-2:]
    heads = qkv.shape[-1] // head_dim - 2 * kv_heads
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (
        q.view(-1, heads, head_dim),
        k.view(-1, kv_heads, head_dim),
        v.view(-1, kv_heads, head_dim),
    )
