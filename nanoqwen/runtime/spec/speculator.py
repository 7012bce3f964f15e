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


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer
        self.stats = SpeculationStats()

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        """Tokens to check after each sequence's newest one: never more than the request may
        still produce beyond the step's own token, nor past the longest sequence, and none
        for structured output (its mask at a later position depends on the tokens before)."""
        limits = [
            0 if s.grammar is not None
            else min(s.params.max_tokens - s.num_output_tokens, self.max_model_len - len(s)) - 1
            for s in seqs
        ]  # fmt: skip
        return self.proposer.propose(seqs, [min(n, self.config.num_speculative_tokens)
                                            for n in limits])  # fmt: skip

    def count(self, verified: Verified) -> None:
        self.stats.num_verified += verified.num_verified
        self.stats.num_proposed += verified.num_proposed
        self.stats.num_accepted += verified.num_accepted
