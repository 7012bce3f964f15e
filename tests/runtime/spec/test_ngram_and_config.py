"""Prompt-lookup proposals against a plain search, and speculative_config's checks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoqwen import EngineConfig, InvalidInputError, SamplingParams
from nanoqwen.runtime.launched_step import PLACEHOLDER
from nanoqwen.runtime.sequence import Sequence
from nanoqwen.runtime.spec.config import SpeculativeConfig
from nanoqwen.runtime.spec.ngram import NgramProposer


def plain_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest n in [min_n, max_n] whose last-n suffix occurs earlier; among those
    occurrences, the latest; what followed it."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_the_tokens_after_the_latest_longest_match_are_proposed():
    p = NgramProposer(min_n=2, max_n=4, num_tokens=3)
    assert p.lookup([1, 2, 3, 4, 5, 6, 1, 2, 3]) == [4, 5, 6]
    # [2, 3] occurs twice: the later occurrence wins.
    assert p.lookup([2, 3, 7, 7, 2, 3, 8, 9, 2, 3]) == [8, 9, 2]
    # A 3-gram match beats a later 2-gram one.
    assert p.lookup([1, 2, 3, 10, 5, 2, 3, 11, 1, 2, 3]) == [10, 5, 2]


def test_nothing_is_proposed_without_a_match_of_min_n_tokens():
    p = NgramProposer(min_n=2, max_n=4, num_tokens=3)
    assert p.lookup([1, 2, 3, 4, 5, 3]) == []  # only a 1-token match
    assert p.lookup([7]) == []
    assert NgramProposer(1, 4, 3).lookup([1, 2, 3, 4, 5, 3]) == [4, 5, 3]


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    steps=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=5), max_size=12),
)
def test_a_growing_sequence_gets_the_proposals_of_a_fresh_search(prompt, steps):
    """propose() keeps each sequence's tokens as an array between steps and appends what a
    step added (one token, or accepted proposals too); what it proposes is the plain search
    over the whole sequence, step after step, and after release as before it."""
    p = NgramProposer(min_n=1, max_n=3, num_tokens=4)
    seq = Sequence(list(prompt), SamplingParams())
    for added in steps:
        for token in added:
            seq.token_ids.append(token)
        assert p.propose([seq], [4]) == [plain_lookup(seq.token_ids, 1, 3, 4)]
        assert p.propose([seq], [0]) == [[]]
        # A token in flight: its placeholder, then the token in its place.
        seq.token_ids.append(PLACEHOLDER)
        p.propose([seq], [4])
        seq.token_ids[-1] = added[0]
        assert p.propose([seq], [4]) == [plain_lookup(seq.token_ids, 1, 3, 4)]
    p.release(seq)
    assert seq.seq_id not in p._arrays
    assert p.propose([seq], [2]) == [plain_lookup(seq.token_ids, 1, 3, 2)]


def test_the_limit_caps_the_proposal():
    p = NgramProposer(min_n=1, max_n=2, num_tokens=5)
    tokens = [1, 2, 3, 4, 5, 6, 7, 1]
    assert p.lookup(tokens) == [2, 3, 4, 5, 6]
    assert p.lookup(tokens, limit=2) == [2, 3]
    assert p.lookup(tokens, limit=0) == []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(1, 6),
)
def test_proposals_equal_a_plain_search(tokens, min_n, extra, k):
    max_n = min_n + extra
    assert NgramProposer(min_n, max_n, k).lookup(tokens) == plain_lookup(tokens, min_n, max_n, k)


def test_config_defaults_follow_vllm():
    c = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    c = SpeculativeConfig.of(text)
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 4, 4)
    assert EngineConfig(speculative_config=c).speculative_config is c


MAPPING = 'allowed a mapping such as {"method": "ngram", "num_speculative_tokens": 4}'
K = "speculative_config.num_speculative_tokens"
BAD = [
    ("{", "speculative_config='{' is not JSON (Expecting property name enclosed in double "
     f"quotes): {MAPPING}"),
    (3, f"speculative_config=3 is an int: {MAPPING}"),
    ({"num_speculative_tokens": 4},
     "speculative_config={'num_speculative_tokens': 4} has no method: allowed ngram, draft"),
    ({"method": "eagle", "num_speculative_tokens": 4},
     "speculative_config.method='eagle' is unknown: allowed ngram, draft"),
    ({"method": "ngram"}, f"{K}=None is not an integer: allowed an integer from 1 to 16"),
    ({"method": "ngram", "num_speculative_tokens": 17},
     f"{K}=17 is out of range: allowed an integer from 1 to 16"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "speculative_config.prompt_lookup_min=0 is out of range: allowed None or n >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_min=4 is above prompt_lookup_max=2: allowed "
     "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 1},
     "speculative_config={'method': 'ngram', 'num_speculative_tokens': 2, 'k': 1} has the key "
     "'k': allowed the keys method, num_speculative_tokens, prompt_lookup_min, "
     "prompt_lookup_max, model"),
    ({"method": "draft", "num_speculative_tokens": 2},
     "speculative_config.model=None is not a path: allowed the draft model's checkpoint "
     "directory, GGUF file or hub id"),
    ({"method": "draft", "model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "speculative_config.prompt_lookup_max=3 is for method ngram: allowed no prompt_lookup_* "
     "with method draft"),
    ({"method": "ngram", "model": "d", "num_speculative_tokens": 2},
     "speculative_config.model='d' is for method draft: allowed no model with method ngram"),
]  # fmt: skip


@pytest.mark.parametrize("value, message", BAD)
def test_bad_configs_are_one_line_errors(value, message):
    with pytest.raises(InvalidInputError) as e:
        EngineConfig(speculative_config=value)
    assert str(e.value) == message


def test_tensor_parallelism_is_refused():
    with pytest.raises(InvalidInputError, match="not supported with tensor_parallel_size=2"):
        EngineConfig(
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            tensor_parallel_size=2,
        )
