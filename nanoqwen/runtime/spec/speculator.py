"""The engine's side of speculative decoding: proposals within each request's limits, and
the counts that the benchmark and /metrics report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from nanoqwen.runtime.sequence import Sequence
from nanoqwen.runtime.spec.config import SpeculativeConfig
from nanoqwen.runtime.spec.verify import Verified


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """For each sequence, at most its limit of tokens guessed to follow it."""

    def release(self, seq: Sequence) -> None:
        """seq stopped running: whatever the proposer keeps for it can go."""


@dataclass
class SpeculationStats:
    num_verified: int = 0  # (sequence, step) pairs that checked at least one proposal
    num_proposed: int = 0  # proposed tokens
    num_accepted: int = 0  # of those, accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a sequence gains per step that checks proposals (accepted ones plus the
        target's own), as vLLM reports it."""
        return 1 + self.num_accepted / self.num_verified if self.num_verified else 0.0


# Steps a sequence goes without proposals after its n-th miss in a row: 2**n - 1, up to a
# cap. A proposal that the target rejects cost a verify step for nothing; a lookup that finds
# nothing cost only the wait for the step's tokens, and may match again a few tokens later
# (the answer starts quoting its prompt again), so it backs off less.
MAX_BACKOFF_REJECTED = 15
MAX_BACKOFF_UNMATCHED = 3


class Speculator:
    """Proposals within each request's limits and, with backs_off (on a GPU), a backoff per
    sequence: one whose proposals keep missing (nothing proposed, or nothing accepted)
    proposes less and less often, so that where speculation does not pay the engine runs
    plain steps, one step ahead (LLM._step_speculative), instead of waiting for every step's
    tokens and paying for verify rows. On the CPU a step is not run ahead and a verify step
    costs about a decode step, so a miss costs nearly nothing there: every step proposes."""

    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        proposer: Proposer,
        backs_off: bool = False,
    ) -> None:
        self.config = config
        self.backs_off = backs_off
        self.max_model_len = max_model_len
        self.proposer = proposer
        self.stats = SpeculationStats()
        self.step = 0  # schedule() calls so far
        # Set while the engine runs a plain step ahead: a sequence swapped back in may be
        # due, but another step's tokens are still in flight.
        self.holding = False
        # seq_id -> (misses in a row, the step from which it proposes again)
        self.backoff: dict[int, tuple[int, int]] = {}

    def due(self, seqs: list[Sequence]) -> bool:
        """Whether any of seqs would propose at the next step."""
        return any(self._resumes(s) <= self.step + 1 for s in seqs)

    def _resumes(self, seq: Sequence) -> int:
        return self.backoff.get(seq.seq_id, (0, 0))[1]

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        """Tokens to check after each sequence's newest one: never more than the request may
        still produce beyond the step's own token, nor past the longest sequence, and none
        for structured output (its mask at a later position depends on the tokens before)
        or for a sequence backing off."""
        self.step += 1
        limits = [
            0 if self.holding or s.grammar is not None or self._resumes(s) > self.step
            else min(s.params.max_tokens - s.num_output_tokens, self.max_model_len - len(s)) - 1
            for s in seqs
        ]  # fmt: skip
        limits = [min(n, self.config.num_speculative_tokens) for n in limits]
        if not any(n > 0 for n in limits):
            return [[] for _ in seqs]
        proposals = self.proposer.propose(seqs, limits)
        for seq, proposal, limit in zip(seqs, proposals, limits):
            if limit > 0 and not proposal:
                self._missed(seq, MAX_BACKOFF_UNMATCHED)
        return proposals

    def count(self, verified: Verified, seqs: list[Sequence], proposals: list[list[int]]) -> None:
        self.stats.num_verified += verified.num_verified
        self.stats.num_proposed += verified.num_proposed
        self.stats.num_accepted += verified.num_accepted
        for seq, proposal, tokens in zip(seqs, proposals, verified.tokens):
            if not proposal:
                continue
            if len(tokens) > 1:  # some accepted
                self.backoff.pop(seq.seq_id, None)
            else:
                self._missed(seq, MAX_BACKOFF_REJECTED)

    def _missed(self, seq: Sequence, cap: int) -> None:
        if not self.backs_off:
            return
        misses = min(self.backoff.get(seq.seq_id, (0, 0))[0] + 1, 8)  # 2**8 - 1: past the caps
        self.backoff[seq.seq_id] = (misses, self.step + 1 + min(2**misses - 1, cap))

    def release(self, seq: Sequence) -> None:
        self.backoff.pop(seq.seq_id, None)
        self.proposer.release(seq)
