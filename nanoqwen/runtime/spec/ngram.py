"""Prompt-lookup proposals: the tokens that followed the latest earlier occurrence of a
sequence's last n tokens, for the largest n in [min_n, max_n] that occurs."""

from __future__ import annotations

import numpy as np

from nanoqwen.runtime.sequence import Sequence


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, num_tokens: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.num_tokens = num_tokens

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """For each sequence, at most its limit of tokens to follow it."""
        return [self.lookup(s.token_ids, limit) for s, limit in zip(seqs, limits)]

    def release(self, seq: Sequence) -> None:
        """Nothing to let go of: lookups keep no state between steps."""

    def lookup(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        """Up to min(num_tokens, limit) tokens to follow token_ids; [] when nothing matches."""
        k = self.num_tokens if limit is None else min(self.num_tokens, limit)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        end = len(tokens) - 1
        # Candidate matches end where the last token occurred before; each is then extended
        # backwards one token at a time, all candidates at once.
        ends = np.flatnonzero(tokens[:end] == tokens[end])
        if ends.size == 0:
            return []
        length = np.ones(ends.size, dtype=np.int64)
        for m in range(1, self.max_n):
            extend = (length == m) & (ends >= m)
            idx = np.flatnonzero(extend)
            if idx.size == 0:
                break
            same = tokens[ends[idx] - m] == tokens[end - m]
            length[idx[same]] += 1
        good = np.flatnonzero(length >= self.min_n)
        if good.size == 0:
            return []
        # The longest match, and the latest among the longest.
        best = good[np.flatnonzero(length[good] == length[good].max())[-1]]
        start = int(ends[best]) + 1
        return tokens[start : start + k].tolist()
