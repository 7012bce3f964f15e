"""A step queued on the device whose sampled tokens are not read back yet.

Until they are, each sequence that sampled holds PLACEHOLDER as its newest token id; the next
decode step takes the real token straight from the device tensor (ModelRunner.token_sources).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanoqwen.runtime.logprobs import TokenLogprobs
from nanoqwen.runtime.sequence import Sequence

PLACEHOLDER = -1


def rows_in_place(ids: list[int], sources: list[int]) -> int:
    """m > 0 where ids[:m] are all placeholders, each held by its own row of the last step's
    tokens (sources[i] == i), and no placeholder follows: a batch decoding on as it was, whose
    ids are the last tokens' first m rows as they lie. Else 0."""
    m = 0
    while m < len(ids) and ids[m] == PLACEHOLDER and sources[m] == m:
        m += 1
    return m if m and PLACEHOLDER not in ids[m:] else 0


@dataclass
class LaunchedStep:
    seqs: list[Sequence]  # the sequences that receive a token from this step
    tokens: torch.Tensor | None  # their sampled tokens, on the device
    host: torch.Tensor | None  # pinned copy of tokens, filled when `done` fires
    done: torch.cuda.Event | None
    # With logprobs asked for: host copies of Sampler.logprobs() for these rows.
    logprobs: tuple[torch.Tensor, ...] | None = None
    # Prompt logprobs computed this step: (sequence, first prompt position, host tensors).
    prompt_logprobs: list[tuple[Sequence, int, tuple[torch.Tensor, ...]]] = field(
        default_factory=list
    )
    # With tensor parallelism: raises if a rank died, checked while result() waits.
    watch: Callable[[], None] | None = None
    # A step with structured output is launched up to its logits; this queues its sampling,
    # with masks from the grammars as they are when it runs.
    pending: Callable[[], None] | None = None

    def complete(self) -> None:
        """Queues what is left of the step (its sampling), if anything."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending()

    def result(self) -> list[int]:
        self.complete()
        if self.done is not None and self.watch is None:
            self.done.synchronize()
        elif self.done is not None:
            while not self.done.query():
                self.watch()
        return self.host.tolist()


def logprob_entries(tensors: tuple[torch.Tensor, ...], tokens: list[int]) -> list[TokenLogprobs]:
    """Sampler.logprobs() output (host tensors) as one entry per row, with every top
    alternative computed; callers cut each to what its request asked for."""
    lp, rank, top_lp, top_ids = (t.tolist() for t in tensors)
    return [
        TokenLogprobs(token, lp[r], rank[r], list(zip(top_ids[r], top_lp[r])))
        for r, token in enumerate(tokens)
    ]
