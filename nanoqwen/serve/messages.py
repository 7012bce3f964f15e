"""What the HTTP process and the engine process say to each other (pickled over pipes).

HTTP -> engine: lists of AddRequest / AbortRequest / Shutdown, in the order they were made.
Engine -> HTTP: first one EngineReady or EngineStartupError, then lists of StepOutputs (one
per engine step; several when the HTTP process reads slower than the engine steps).

A step's output is mostly one new token per running request and nothing else: those ride in
parallel lists (StepOutputs.request_ids / token_ids / texts), which pickle and unpickle ~5x
faster than a tuple per request. The rest (finished requests, logprobs, several tokens at
once) ride in plain tuples in the field order of OutputRow. There is no object per token."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoqwen.runtime.logprobs import TokenLogprobs
from nanoqwen.runtime.sampling_params import SamplingParams

# (request id, new text, new token ids, finished, finish reason, logprobs of the new tokens,
# what a request's output carries once, or None)
OutputRow = tuple[
    int, str, list[int], bool, str | None, list[TokenLogprobs] | None, "RowExtras | None"
]


@dataclass
class RowExtras:
    """Sent once per request: its prompt's logprobs with its first tokens (when asked for),
    the prompt tokens the prefix cache held with its last."""

    prompt_logprobs: list[TokenLogprobs | None] | None = None
    cached_tokens: int | None = None


@dataclass
class AddRequest:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class AbortRequest:
    request_id: int


@dataclass
class Shutdown:
    pass


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int  # in the scheduler's queue
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    num_added: int  # AddRequests taken in since the start, failed ones too
    # Speculative decoding, since the start: (sequence, step) pairs that checked proposals,
    # proposed tokens, accepted ones.
    num_spec_verified: int = 0
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0


@dataclass
class StepOutputs:
    # request_ids[i] made the one token token_ids[i], whose new text is texts[i] ("" without
    # a tokenizer, or while it is held back); none of them finished.
    request_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    rows: list[OutputRow] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)  # (request id, why)
    stats: EngineStats | None = None


@dataclass
class EngineReady:
    max_model_len: int
    vocab_size: int


@dataclass
class EngineStartupError:
    """The engine could not load: the CLI's one-line message and exit status for it."""

    message: str
    exit_code: int
