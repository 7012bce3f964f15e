"""Per-request generation settings, validated when built."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nanoqwen.errors import InvalidInputError
from nanoqwen.runtime.logprobs import MAX_LOGPROBS
from nanoqwen.runtime.sampling.logit_bias import check_logit_bias
from nanoqwen.runtime.sampling.structured import StructuredOutput
from nanoqwen.validation import (
    a_type,
    boolean,
    integer,
    invalid,
    number,
    optional_integer,
    token_ids,
)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    # Per sampled / prompt token: its log-probability and the top-N alternatives.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Constrains the text to a JSON schema, any JSON object, a regex or a grammar:
    # a StructuredOutput, or a mapping of its fields.
    structured_output: StructuredOutput | None = None
    # OpenAI's logit_bias: {token id: a number in [-100, 100]} added to those logits.
    logit_bias: dict[int, float] | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Each value is checked for its type and range, then stored normalized (ints given for
        # floats become floats), so nothing downstream sees a bool, a string or a NaN.
        self.temperature = number(
            "temperature", self.temperature, lambda v: v >= 0, "a number >= 0 (0 = greedy)"
        )
        self.top_p = number("top_p", self.top_p, lambda v: 0 < v <= 1, "a number in (0, 1]")
        self.top_k = integer(
            "top_k", self.top_k, lambda v: v == -1 or v >= 1, "-1 (off) or an integer >= 1"
        )
        self.min_p = number("min_p", self.min_p, lambda v: 0 <= v <= 1, "a number in [0, 1]")
        self.repetition_penalty = number(
            "repetition_penalty", self.repetition_penalty, lambda v: v > 0, "a number > 0 (1 = off)"
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = number(name, getattr(self, name), lambda v: -2 <= v <= 2, "a number in [-2, 2]")
            setattr(self, name, value)
        self.max_tokens = integer(
            "max_tokens", self.max_tokens, lambda v: v >= 1, "an integer >= 1"
        )
        self.min_tokens = integer(
            "min_tokens",
            self.min_tokens,
            lambda v: 0 <= v <= self.max_tokens,
            f"an integer from 0 to max_tokens ({self.max_tokens})",
        )
        self.ignore_eos = boolean("ignore_eos", self.ignore_eos)
        self.seed = optional_integer(
            "seed", self.seed, lambda v: 0 <= v < 2**63, "an integer from 0 to 2**63 - 1"
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = optional_integer(
                name, getattr(self, name), lambda v: 0 <= v <= MAX_LOGPROBS, f"0..{MAX_LOGPROBS}"
            )
            setattr(self, name, value)
        self.structured_output = StructuredOutput.of(self.structured_output)
        self.logit_bias = check_logit_bias(self.logit_bias)
        self.stop_strings = _stop_strings(self.stop)
        # Ids past the vocabulary are refused by the engine, which knows its size.
        self.stop_token_ids = token_ids("stop_token_ids", self.stop_token_ids or [])

    @classmethod
    def from_dict(cls, data: Any) -> SamplingParams:
        """From a mapping of field names (a request body, say); unknown names are refused."""
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        if not isinstance(data, Mapping):
            raise invalid("sampling_params", data, "is not a mapping", "an object of parameters")
        for key in data:
            if key not in names:
                raise InvalidInputError(
                    f"unknown sampling parameter {str(key)[:40]!r}: allowed {', '.join(names)}",
                    param=str(key),
                )
        return cls(**data)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _stop_strings(stop: Any) -> tuple[str, ...]:
    allowed = "None, a non-empty string or a list of them"
    if stop is None:
        return ()
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, (list, tuple)):
        stops = list(stop)
    else:
        raise invalid("stop", stop, f"is {a_type(stop)}", allowed)
    for s in stops:
        if not isinstance(s, str):
            raise invalid("stop", stop, f"holds {a_type(s)}", allowed)
        if not s:
            raise invalid("stop", stop, "holds an empty string", allowed)
    return tuple(stops)
