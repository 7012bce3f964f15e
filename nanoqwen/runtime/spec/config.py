"""SpeculativeConfig: the engine's speculative_config, named as vLLM names it.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 4}
    {"method": "draft", "model": "path/to/small-or-quantized", "num_speculative_tokens": 4}

ngram (prompt lookup): the last n tokens of a sequence (n from prompt_lookup_max down to
prompt_lookup_min) are looked up in its earlier tokens, prompt and output; what followed the
latest match is proposed, up to num_speculative_tokens tokens. Without either bound both are
5, as in vLLM; with one, the other takes its value.

draft: another Qwen2.5 checkpoint with the same tokenizer (a smaller one, or the same model
quantized: a GGUF file) decodes num_speculative_tokens tokens greedily to propose them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from nanoqwen.validation import a_type, integer, invalid, optional_integer

METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # draft

    def __post_init__(self) -> None:
        name = "speculative_config"
        if self.method not in METHODS:
            raise invalid(f"{name}.method", self.method, "is unknown", ", ".join(METHODS))
        if self.method == "draft":
            if not isinstance(self.model, str) or not self.model:
                allowed = "the draft model's checkpoint directory, GGUF file or hub id"
                raise invalid(f"{name}.model", self.model, "is not a path", allowed)
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, key) is not None:
                    raise invalid(f"{name}.{key}", getattr(self, key), "is for method ngram",
                                  "no prompt_lookup_* with method draft")  # fmt: skip
        elif self.model is not None:
            raise invalid(f"{name}.model", self.model, "is for method draft",
                          "no model with method ngram")  # fmt: skip
        integer(
            f"{name}.num_speculative_tokens", self.num_speculative_tokens,
            lambda v: 1 <= v <= MAX_SPECULATIVE_TOKENS,
            f"an integer from 1 to {MAX_SPECULATIVE_TOKENS}",
        )  # fmt: skip
        for field in ("prompt_lookup_min", "prompt_lookup_max"):
            optional_integer(f"{name}.{field}", getattr(self, field), lambda v: v >= 1, "n >= 1")
        if self.method == "draft":
            return
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_LOOKUP
        low, high = low or high, high or low
        if low > high:
            raise invalid(
                f"{name}.prompt_lookup_min", low, f"is above prompt_lookup_max={high}",
                "prompt_lookup_min <= prompt_lookup_max",
            )  # fmt: skip
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def of(cls, value: Any) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, a mapping of its fields, or that mapping as JSON text
        (the --speculative-config flag)."""
        if value is None or isinstance(value, cls):
            return value
        allowed = 'a mapping such as {"method": "ngram", "num_speculative_tokens": 4}'
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise invalid(
                    "speculative_config", value, f"is not JSON ({e.msg})", allowed
                ) from None
        if not isinstance(value, Mapping):
            raise invalid("speculative_config", value, f"is {a_type(value)}", allowed)
        known = [f.name for f in fields(cls)]
        for key in value:
            if key not in known:
                raise invalid("speculative_config", dict(value), f"has the key {key!r}",
                              "the keys " + ", ".join(known))  # fmt: skip
        if "method" not in value:
            raise invalid("speculative_config", dict(value), "has no method", ", ".join(METHODS))
        return cls(**{"num_speculative_tokens": None} | dict(value))
