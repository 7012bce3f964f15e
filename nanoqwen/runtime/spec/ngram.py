"""Prompt-lookup proposals: the tokens that followed the latest earlier occurrence of a
sequence's last n tokens, for the largest n in [min_n, max_n] that occurs."""

from __future__ import annotations

import numpy as np

from nanoqwen.runtime.sequence import Sequence

IN_FLIGHT = 2  # tokens of a sequence that may be placeholders (output_processor.py)


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, num_tokens: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.num_tokens = num_tokens
        # seq_id -> (array whose first `filled` entries are the sequence's tokens, filled):
        # a step appends its new tokens instead of converting the whole list again, which
        # took most of a lookup's time (52 of 80 µs at 2,000 tokens).
        self._arrays: dict[int, tuple[np.ndarray, int]] = {}

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """For each sequence, at most its limit of tokens to follow it."""
        return [self.lookup(self._tokens(s), limit) if limit > 0 else []
                for s, limit in zip(seqs, limits)]  # fmt: skip

    def _tokens(self, seq: Sequence) -> np.ndarray:
        """seq's tokens as an int64 array (a view of its cached one)."""
        ids = seq.token_ids
        array, filled = self._arrays.get(seq.seq_id, (np.empty(0, np.int64), 0))
        # The newest entries cached may have been placeholders of tokens then in flight
        # (at most two a sequence), since replaced: copy them again.
        filled = max(0, min(filled, len(ids)) - IN_FLIGHT)
        if len(ids) > array.size:
            grown = np.empty(max(2 * len(ids), 256), np.int64)
            grown[:filled] = array[:filled]
            array = grown
        array[filled : len(ids)] = ids[filled:]
        self._arrays[seq.seq_id] = (array, len(ids))
        return array[: len(ids)]

    def release(self, seq: Sequence) -> None:
        """seq stopped running (finished, retired or preempted): its array goes."""
        self._arrays.pop(seq.seq_id, None)

    def lookup(self, token_ids: list[int] | np.ndarray, limit: int | None = None) -> list[int]:
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
