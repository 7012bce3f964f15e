"""What the HTTP process and the engine process say to each other (pickled over pipes).

HTTP -> engine: lists of AddRequest / AbortRequest / Shutdown, in the order they were made.
Engine -> HTTP: first one EngineReady or EngineStartupError, then lists of StepOutputs (one
per engine step; several when the HTTP process reads slower than the engine steps).

Per-request output rides in plain tuples, the cheapest thing to pickle, in the field order of
OutputRow; there is no object per token."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoqwen.runtime.logprobs import TokenLogprobs
from nanoqwen.runtime.sampling_params import SamplingParams

# (request id, new text, new token ids, finished, finish reason, logprobs of the new tokens)
OutputRow = tuple[int, str, list[int], bool, str | None, list[TokenLogprobs] | None]


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


@dataclass
class StepOutputs:
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
