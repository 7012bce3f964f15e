"""The engine's side of speculative decoding: proposals within each request's limits, and
the counts that the benchmark and /metrics report."""

from __future__ import annotations

from dataclasses import dataclass

from nanoqwen.runtime.sequence import Sequence
from nanoqwen.runtime.spec.config import SpeculativeConfig
from nanoqwen.runtime.spec.ngram import NgramProposer
from nanoqwen.runtime.spec.verify import Verified


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
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(
            config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens
        )
        self.stats = SpeculationStats()

    def propose(self, seq: Sequence) -> list[int]:
        """Tokens to check after seq's newest one: never more than the request may still
        produce beyond the step's own token, nor past the longest sequence."""
        if seq.grammar is not None:
            return []  # its mask for a later position depends on the tokens before it
        room = min(
            seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq)
        )  # fmt: skip
        return self.proposer.propose(seq.token_ids, room - 1)

    def count(self, verified: Verified, proposals: list[list[int]]) -> None:
        self.stats.num_verified += sum(1 for p in proposals if p)
        self.stats.num_proposed += verified.num_proposed
        self.stats.num_accepted += verified.num_accepted
