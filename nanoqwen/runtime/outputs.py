"""What the engine hands back: a finished request's RequestOutput, and the StreamChunks of
one that is streamed."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoqwen.runtime.detokenizer import IncrementalDetokenizer
from nanoqwen.runtime.logprobs import TokenLogprobs
from nanoqwen.runtime.sequence import Sequence


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only, a final EOS or stop token included
    text: str
    finish_reason: str  # "stop" or "length"
    metrics: dict[str, float] = field(default_factory=dict)
    # With SamplingParams.logprobs: one entry per generated token.
    logprobs: list[TokenLogprobs] | None = None
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # As vLLM reports it: the stop token id or stop string that ended the request; None when
    # EOS, max_tokens or the context length (max_model_len) did.
    stop_reason: int | str | None = None
    # Prompt tokens whose K/V came from the prefix cache when the request was admitted.
    num_cached_tokens: int = 0


@dataclass
class StreamChunk:
    index: int  # position of the request in the prompts given
    text: str  # new text since the last chunk of this request
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None  # for token_ids, with SamplingParams.logprobs
    stop_reason: int | str | None = None  # on the finished chunk, as in RequestOutput


def stop_reason(seq: Sequence, detok: IncrementalDetokenizer | None) -> int | str | None:
    if seq.stop_reason is None and detok is not None and detok.stopped:
        return detok.stop_string
    return seq.stop_reason


def request_output(seq: Sequence, detok: IncrementalDetokenizer | None, tokenizer) -> RequestOutput:
    """seq's RequestOutput, its text from its detokenizer (streamed requests) or decoded."""
    if detok is not None:
        text = detok.text
    elif tokenizer is not None:
        text = tokenizer.decode(seq.output_token_ids)
    else:
        text = ""
    metrics = {}
    if seq.first_token_time is not None and seq.finish_time is not None:
        metrics = {
            "ttft_s": seq.first_token_time - seq.arrival_time,
            "latency_s": seq.finish_time - seq.arrival_time,
        }
    return RequestOutput(
        seq.token_ids[: seq.num_prompt_tokens],
        seq.output_token_ids,
        text,
        seq.finish_reason or "length",
        metrics,
        seq.logprobs,
        seq.prompt_logprobs,
        stop_reason=stop_reason(seq, detok),
        num_cached_tokens=seq.num_cached_tokens or 0,
    )


def stream_chunk(seq: Sequence, detok: IncrementalDetokenizer | None, index: int) -> StreamChunk:
    """The tokens (and their text and logprobs) seq made since its last chunk."""
    tokens, seq.unstreamed = seq.unstreamed or [], []
    text = detok.pending(final=seq.is_finished) if detok else ""
    logprobs = None
    if seq.logprobs is not None:
        logprobs = seq.logprobs[seq.num_streamed : seq.num_streamed + len(tokens)]
    seq.num_streamed += len(tokens)
    stop = stop_reason(seq, detok) if seq.is_finished else None
    return StreamChunk(index, text, tokens, seq.is_finished, seq.finish_reason, logprobs, stop)
