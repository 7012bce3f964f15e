"""OutputProcessor: takes the tokens a step produced into their sequences: logprobs, stop
checks (EOS, stop tokens and strings, max_tokens, the model length, a grammar's end),
incremental detokenizing, and the finished sequences handed back to the scheduler."""

from __future__ import annotations

import time

from nanoqwen.runtime.detokenizer import IncrementalDetokenizer
from nanoqwen.runtime.launched_step import PLACEHOLDER, LaunchedStep, logprob_entries
from nanoqwen.runtime.logprobs import TokenLogprobs
from nanoqwen.runtime.outputs import RequestOutput, StreamChunk, request_output, stream_chunk
from nanoqwen.runtime.scheduler import Batch, Scheduler
from nanoqwen.runtime.sequence import Sequence
from nanoqwen.runtime.spec.verify import Verified
from nanoqwen.weights.tokenizer import Tokenizer

Resolved = list[tuple[Sequence, int]]  # (sequence, new token) for each live sequence


def _cut(entry: TokenLogprobs, top: int) -> TokenLogprobs:
    """entry with only the top alternatives its request asked for."""
    entry.top = entry.top[:top]
    return entry


class OutputProcessor:
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer | None,
        eos_token_ids: frozenset[int],
        max_model_len: int,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}

    def track(self, seq: Sequence, detokenize: bool) -> None:
        """A new request: its text is made as its tokens come when asked for, or when stop
        strings need it."""
        if (detokenize or seq.params.stop_strings) and self.tokenizer is not None:
            self.detokenizers[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer, seq.params.stop_strings, seq.params.min_tokens
            )

    def forget(self, seq: Sequence) -> None:
        self.detokenizers.pop(seq.seq_id, None)

    def reaches_length_limit(self, seq: Sequence, length: int) -> bool:
        """Whether seq, once `length` tokens long, has to end whatever its last token is."""
        outputs = length - seq.num_prompt_tokens
        return outputs >= seq.params.max_tokens or length >= self.max_model_len

    def finish_reason(self, seq: Sequence, token: int, length: int) -> str | None:
        """Why seq ends with token at position length - 1, or None to go on."""
        p = seq.params
        if seq.grammar is not None:
            # Its mask allowed token; the grammar's end (or EOS after it) ends the request.
            if not seq.grammar.accept(token):  # only a dead end lets one through
                seq.stop_reason = "grammar"
                return "stop"
            if seq.grammar.finished or token in self.eos_token_ids:
                return "stop"
        if token in p.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        outputs = length - seq.num_prompt_tokens
        if not p.ignore_eos and token in self.eos_token_ids and outputs >= p.min_tokens:
            return "stop"
        return "length" if self.reaches_length_limit(seq, length) else None

    def apply_launched(self, launched: LaunchedStep) -> Resolved:
        """Reads back a launched step's tokens and takes each into its sequence."""
        now = time.perf_counter()
        resolved = []
        tokens = launched.result()
        for seq, first, tensors in launched.prompt_logprobs:
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None]
            targets = seq.token_ids[first : first + len(tensors[0])]
            top = seq.params.prompt_logprobs
            seq.prompt_logprobs += [_cut(e, top) for e in logprob_entries(tensors, targets)]
        entries = logprob_entries(launched.logprobs, tokens) if launched.logprobs else None
        apply = self.apply  # once a step: this loop runs for every sequence
        for row, (seq, token) in enumerate(zip(launched.seqs, tokens)):
            if seq.is_finished:  # aborted while its token was in flight
                continue
            # At most two tokens are in flight per sequence; this step's is the older one.
            ids = seq.token_ids
            pos = len(ids) - 1
            if ids[pos - 1] == PLACEHOLDER and pos > seq.num_prompt_tokens:
                pos -= 1
            ids[pos] = token
            apply(seq, token, pos + 1, now, entries[row] if entries else None)
            resolved.append((seq, token))
        return resolved

    def apply_verified(self, batch: Batch, verified: Verified) -> Resolved:
        """Takes in each sequence's accepted proposals and the target's own token after them."""
        now = time.perf_counter()
        resolved = []
        for i, (seq, tokens) in enumerate(zip(batch.seqs, verified.tokens)):
            # Its newest token and the accepted proposals have their K/V in the cache now.
            seq.num_computed_tokens = len(seq) - 1 + len(tokens)
            for n, token in enumerate(tokens):
                seq.token_ids.append(token)
                entry = verified.logprobs[i][n] if verified.logprobs else None
                resolved.append((seq, token))
                if self.apply(seq, token, len(seq), now, entry):
                    break
            if not seq.is_finished:
                self.scheduler.blocks.trim(seq, len(seq))
        return resolved

    def apply(
        self, seq: Sequence, token: int, length: int, now: float, entry: TokenLogprobs | None
    ) -> bool:
        """Takes in seq's token at position length - 1 (already in token_ids): streaming,
        logprobs, stop checks, detokenizing. Returns whether seq finished with it."""
        if seq.unstreamed is not None:
            seq.unstreamed.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if seq.logprobs is not None:
            seq.logprobs.append(_cut(entry, seq.params.logprobs))
        reason = self.finish_reason(seq, token, length)
        detok = self.detokenizers.get(seq.seq_id)
        if detok is not None:
            detok.add([token], final=reason is not None)
            if detok.stopped and reason is None:
                reason = "stop"
        if reason is None:
            return False
        del seq.token_ids[length:]  # a newer step's token in flight, if any
        seq.finish_time = now
        self.scheduler.finish(seq, reason)
        return True

    def output(self, seq: Sequence) -> RequestOutput:
        """A finished request's whole output (its detokenizer is done with)."""
        return request_output(seq, self.detokenizers.pop(seq.seq_id, None), self.tokenizer)

    def take_output(self, seq: Sequence, index: int = 0) -> StreamChunk | None:
        """The tokens and text seq made since the last call, or None when there is nothing
        new."""
        if not seq.unstreamed and not seq.is_finished:
            return None
        # A finished request's detokenizer is done with: drop it.
        take = self.detokenizers.pop if seq.is_finished else self.detokenizers.get
        return stream_chunk(seq, take(seq.seq_id, None), index)
