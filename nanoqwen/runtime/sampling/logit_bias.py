"""OpenAI's logit_bias: per request, a number added to chosen tokens' logits before sampling
(-100 bans a token in practice, +100 all but forces it). A step whose batch holds such a
request adds them to a copy of its logits in one scatter; other steps do nothing."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from nanoqwen.validation import a_type, invalid, is_int, is_number

MAX_BIAS = 100.0  # OpenAI's range: -100..100


def check_logit_bias(value: Any) -> dict[int, float] | None:
    """{token id: bias}: ids as ints (or their decimal text, as JSON object keys carry them),
    biases finite numbers in [-100, 100]. Ids past the vocabulary are the engine's check."""
    if value is None:
        return None
    allowed = "a mapping of token ids to numbers in [-100, 100]"
    if not isinstance(value, Mapping):
        raise invalid("logit_bias", value, f"is {a_type(value)}", allowed)
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
        if not is_int(token) or token < 0:
            raise invalid("logit_bias", value, f"has the key {key!r}, not a token id", allowed)
        if not is_number(bias) or not math.isfinite(bias) or abs(bias) > MAX_BIAS:
            raise invalid("logit_bias", value, f"maps {key} to {bias!r}", allowed)
        out[int(token)] = float(bias)
    return out or None


def biased_logits(
    logits: torch.Tensor, row_biases: list[dict[int, float] | None], to_device
) -> torch.Tensor:
    """logits [rows, vocab], or a copy with each row's biases added. to_device(list, dtype)
    sends a host list without waiting (from pinned memory on a GPU)."""
    rows, ids, biases = [], [], []
    for row, row_bias in enumerate(row_biases):
        for token, bias in (row_bias or {}).items():
            rows.append(row)
            ids.append(token)
            biases.append(bias)
    if not rows:
        return logits
    out = logits.clone()
    values = to_device(biases, torch.float32).to(out.dtype)
    out.index_put_((to_device(rows, torch.int64), to_device(ids, torch.int64)), values,
                   accumulate=True)  # fmt: skip
    return out
