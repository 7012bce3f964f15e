"""Incremental detokenization and stop-string detection for one sequence."""

from __future__ import annotations

from nanoqwen.weights.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Emits text as tokens arrive, holding back incomplete UTF-8 and possible stop-string
    prefixes, so that the streamed pieces join to exactly the final text.

    As in vLLM, a stop string counts only once more than min_tokens tokens are out: one that
    ends within the text of the first min_tokens tokens is ignored."""

    def __init__(
        self, tokenizer: Tokenizer, stop_strings: tuple[str, ...], min_tokens: int = 0
    ) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.min_tokens = min_tokens
        self._stop_floor = 0  # stop strings must end past this text offset
        self._hold = max((len(s) for s in stop_strings), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # decoded so far, trimmed at a stop string once one is found
        self._emitted = 0
        self.stopped = False
        self.stop_string: str | None = None  # the stop string found, once stopped

    def add(self, token_ids: list[int], final: bool = False) -> None:
        """final: the sequence ended, so text held back for incomplete UTF-8 goes out too."""
        if self.stopped:
            return
        self._ids.extend(token_ids)
        # Decoding a short window keeps the cost per token constant on long outputs.
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self.tokenizer.decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return
        start = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if len(self._ids) <= self.min_tokens:
            self._stop_floor = len(self.text)
        elif self.stop_strings:
            self._find_stop(max(start, self._stop_floor))

    def _find_stop(self, new_from: int) -> None:
        """Finds the first stop string that ends in text[new_from:]."""
        hits = [
            (i, s)
            for s in self.stop_strings
            if (i := self.text.find(s, max(0, new_from - len(s) + 1))) >= 0
        ]
        if hits:
            at, self.stop_string = min(hits, key=lambda hit: hit[0])
            self.text = self.text[:at]
            self.stopped = True

    def pending(self, final: bool) -> str:
        """The text not yet handed out; unless final, what could still start a stop string
        is kept back."""
        held = 0 if final or self.stopped else self._hold
        end = max(self._emitted, len(self.text) - held)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
