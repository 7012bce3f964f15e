"""Per-request generation settings, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoqwen.runtime.logprobs import MAX_LOGPROBS


def _check(name: str, value: float, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is out of range: allowed {allowed}")


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
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check("temperature", self.temperature, self.temperature >= 0, ">= 0 (0 = greedy)")
        _check("top_p", self.top_p, 0 < self.top_p <= 1, "0 < top_p <= 1")
        _check("top_k", self.top_k, self.top_k == -1 or self.top_k >= 1, "-1 (off) or >= 1")
        _check("min_p", self.min_p, 0 <= self.min_p <= 1, "0 <= min_p <= 1")
        _check("repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0, "> 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(name, value, -2 <= value <= 2, "-2 <= value <= 2")
        _check("max_tokens", self.max_tokens, self.max_tokens >= 1, ">= 1")
        _check(
            "min_tokens",
            self.min_tokens,
            0 <= self.min_tokens <= self.max_tokens,
            f"0 <= min_tokens <= max_tokens ({self.max_tokens})",
        )
        if self.seed is not None:
            _check("seed", self.seed, 0 <= self.seed < 2**63, "0 <= seed < 2**63")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(name, value, 0 <= value <= MAX_LOGPROBS, f"None or 0..{MAX_LOGPROBS}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop={self.stop!r} is invalid: allowed non-empty strings")
        self.stop_strings = tuple(stops)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]

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
