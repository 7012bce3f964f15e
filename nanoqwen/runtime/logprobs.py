"""Log-probabilities returned with a request: the chosen token's and the top alternatives."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20


@dataclass
class TokenLogprobs:
    """One position: the token there, its log-probability under the model's raw
    log-softmax (before penalties, temperature and filtering, as vLLM reports by default),
    its rank among all tokens (1 = most likely), and the top-N alternatives, most likely
    first, as (token id, log-probability)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]
