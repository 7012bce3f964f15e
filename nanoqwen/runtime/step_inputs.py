"""One step's model inputs as host lists, how a scheduled Batch becomes them, and their
StepBuffer layout (the form in which they reach the device)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np

from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.runtime.step_buffer import Layout

if TYPE_CHECKING:
    from nanoqwen.runtime.kv.block_manager import BlockManager
    from nanoqwen.runtime.kv.cache import KVCache
    from nanoqwen.runtime.scheduler import Batch
    from nanoqwen.runtime.sequence import Sequence

PROMPT_LOGPROB_CHUNK = 512  # prompt rows turned into logits at a time


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

    def layout(self) -> Layout:
        return step_layout(
            len(self.ids), len(self.context_lens), self.width, len(self.logit_rows),
            self.is_prefill, self.sources is not None,
        )  # fmt: skip

    def write(self, f: SimpleNamespace) -> None:
        """Into the numpy fields of a StepBuffer of layout()."""
        f.ids[:] = self.ids
        f.positions[:] = self.positions
        f.slots[:] = self.slots
        if self.sources is not None:
            f.sources[:] = self.sources
        f.logit_rows[:] = self.logit_rows
        f.context_lens[:] = self.context_lens
        f.cu_seqlens_q[:] = self.cu_seqlens_q
        if self.is_prefill:
            f.cu_seqlens_k[:] = self.cu_seqlens_k
        if self.block_tables:
            f.block_tables[:] = np.asarray(self.block_tables, dtype=np.int32)


def step_layout(
    tokens: int, seqs: int, width: int, rows: int, prefill: bool, pending: bool
) -> Layout:
    """An eager step's buffer: rows are the prefill rows that get logits; pending: decode
    ids include placeholders, whose sources follow."""
    return Layout.of(
        int64={
            "ids": tokens,
            "positions": tokens,
            "slots": tokens,
            "sources": tokens if pending else 0,
            "logit_rows": rows,
        },
        int32={
            "context_lens": seqs,
            "cu_seqlens_q": seqs + 1,
            "cu_seqlens_k": seqs + 1 if prefill else 0,
            "block_tables": (seqs, width),
        },
    )


def step_metadata(
    f: SimpleNamespace, prefill: bool, max_seqlen_q: int, max_seqlen_k: int
) -> AttentionMetadata:
    """The AttentionMetadata over a step's device fields (step_layout's)."""
    return AttentionMetadata(
        is_prefill=prefill,
        positions=f.positions,
        slot_mapping=f.slots,
        context_lens=f.context_lens,
        block_tables=f.block_tables,
        cu_seqlens_q=f.cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        cu_seqlens_k=f.cu_seqlens_k if prefill else None,
    )


class StepInputBuilder:
    """Lays a Batch out as StepInputs: its token ids, positions, KV cache slots and block
    tables (padded with the KV cache's scratch block)."""

    def __init__(self, block_manager: BlockManager, kv_cache: KVCache) -> None:
        self.blocks = block_manager
        self.kv = kv_cache

    def _block_tables(self, batch: Batch, rows: int | None = None) -> list[list[int]]:
        width = max(len(s.block_table) for s in batch.seqs)
        pad = self.kv.scratch_block
        tables = [s.block_table + [pad] * (width - len(s.block_table)) for s in batch.seqs]
        return tables + [[pad] * width] * ((rows or len(tables)) - len(tables))

    def _chunks(self, batch: Batch, chunks: list[tuple[int, list[int]]]) -> StepInputs:
        """Prefill-shaped inputs: for each sequence of batch, (first position, token ids)
        fed this step, attending to everything cached before them; no logit rows yet."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_q, cu_k, ctx = [0], [0], []
        for seq, (start, chunk) in zip(batch.seqs, chunks):
            end = start + len(chunk)
            ids += chunk
            positions.extend(range(start, end))
            slots.extend(self.blocks.slots(seq, start, end))
            cu_q.append(cu_q[-1] + len(chunk))
            cu_k.append(cu_k[-1] + end)
            ctx.append(end)
        return StepInputs(
            is_prefill=True,
            ids=ids,
            positions=positions,
            slots=slots,
            context_lens=ctx,
            block_tables=self._block_tables(batch),
            cu_seqlens_q=cu_q,
            max_seqlen_q=max(len(chunk) for _, chunk in chunks),
            max_seqlen_k=max(ctx),
            cu_seqlens_k=cu_k,
        )

    def prefill(self, batch: Batch) -> StepInputs:
        chunks = [
            (s.num_computed_tokens, s.token_ids[s.num_computed_tokens : s.num_computed_tokens + n])
            for s, n in zip(batch.seqs, batch.num_new_tokens)
        ]
        inputs = self._chunks(batch, chunks)
        ends = inputs.cu_seqlens_q[1:]
        inputs.logit_rows = [end - 1 for i, end in enumerate(ends) if batch.completes(i)]
        inputs.prompt_rows = [(r.start, r.stop) for _, _, r, _ in prompt_logprob_plan(batch)]
        return inputs

    def verify(self, batch: Batch) -> StepInputs:
        """A decode step with proposals: each sequence feeds its newest token (known by now)
        and its proposed tokens, laid out as a prefill chunk, and every row gets logits."""
        chunks = [
            (len(s) - 1, [s.token_ids[-1], *proposal])
            for s, proposal in zip(batch.seqs, batch.proposals)
        ]
        inputs = self._chunks(batch, chunks)
        inputs.logit_rows = list(range(len(inputs.ids)))
        return inputs

    def decode(
        self, batch: Batch, rows: int, ids: list[int], sources: list[int] | None
    ) -> StepInputs:
        """rows >= len(batch.seqs): extra rows are padding that writes to the scratch block.
        ids: each sequence's newest token (PLACEHOLDER if in flight); sources: where those
        in flight are (ModelRunner.token_sources), None when none is."""
        pad = rows - len(batch.seqs)
        scratch_slot = self.kv.scratch_block * self.kv.block_size
        ctx = [len(s) for s in batch.seqs] + [1] * pad
        return StepInputs(
            is_prefill=False,
            ids=ids + [0] * pad,
            positions=[len(s) - 1 for s in batch.seqs] + [0] * pad,
            slots=[self.blocks.slot(s, len(s) - 1) for s in batch.seqs] + [scratch_slot] * pad,
            context_lens=ctx,
            block_tables=self._block_tables(batch, rows),
            cu_seqlens_q=list(range(rows + 1)),
            max_seqlen_q=1,
            max_seqlen_k=max(ctx),
            sources=sources + [0] * pad if sources is not None else None,
        )


def prompt_logprob_plan(batch: Batch) -> list[tuple[Sequence, int, slice, list[int]]]:
    """For prompts that ask for them: (sequence, first prompt position, rows of this step,
    the prompt tokens those rows predict), in chunks of at most PROMPT_LOGPROB_CHUNK rows
    (the row of position p predicts token p + 1)."""
    plan = []
    row = 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        top = seq.params.prompt_logprobs
        start = seq.num_computed_tokens
        first = max(start + 1, seq.prompt_logprobs_launched)
        last = min(start + n, seq.num_prompt_tokens - 1)
        if top is not None and first <= last:
            targets = seq.token_ids[first : last + 1]
            begin = row + first - 1 - start
            for lo in range(0, len(targets), PROMPT_LOGPROB_CHUNK):
                chunk = targets[lo : lo + PROMPT_LOGPROB_CHUNK]
                rows = slice(begin + lo, begin + lo + len(chunk))
                plan.append((seq, first + lo, rows, chunk))
        row += n
    return plan
