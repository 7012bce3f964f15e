"""One step's model inputs as host lists, before they become device tensors."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepInputs:
    """What the model needs for one step (prefill or eager decode), built on the host.

    Tokens of sequence i are rows cu_seqlens_q[i]:cu_seqlens_q[i+1]. In decode, an id may be
    PLACEHOLDER (a token still in flight): sources then names the row of the last launched
    step's tokens that holds it.
    """

    is_prefill: bool
    ids: list[int]
    positions: list[int]
    slots: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]  # all padded to one width
    cu_seqlens_q: list[int]
    max_seqlen_q: int
    max_seqlen_k: int
    cu_seqlens_k: list[int] | None = None  # prefill only
    sources: list[int] | None = None  # decode with placeholders only
    logit_rows: list[int] = field(default_factory=list)  # prefill: rows that get logits
    # Prefill: (start, end) row ranges turned into logits for prompt logprobs, in order.
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)

    @property
    def width(self) -> int:
        return len(self.block_tables[0]) if self.block_tables else 0
