"""logit_bias: +100 forces a token, -100 bans it, and a request without biases beside one
with them keeps its own tokens."""

from __future__ import annotations

import pytest

from nanoqwen import LLM, InvalidInputError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model[0]), num_kv_blocks=64, block_size=16, progress=False)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw)


def test_a_large_bias_forces_and_bans_tokens(llm):
    forced = llm.generate([[5, 6, 7]], greedy(logit_bias={42: 100}))[0].token_ids
    assert forced == [42] * 12
    free = llm.generate([[5, 6, 7]], greedy())[0].token_ids
    banned = llm.generate([[5, 6, 7]], greedy(logit_bias={t: -100 for t in set(free)}))[0]
    assert not set(banned.token_ids) & set(free)


def test_a_free_request_beside_a_biased_one_keeps_its_tokens(llm):
    alone = llm.generate([[9, 8, 7]], greedy())[0].token_ids
    both = llm.generate([[9, 8, 7], [1, 2]], [greedy(), greedy(logit_bias={"17": 100.0})])
    assert both[0].token_ids == alone and both[1].token_ids == [17] * 12


def test_sampled_biases_keep_logprobs_raw(llm):
    out = llm.generate([[5, 6]], greedy(logit_bias={42: 100}, logprobs=0))[0]
    assert out.token_ids[0] == 42 and out.logprobs[0].logprob < 0  # the model's own


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({42: 101}, "logit_bias={42: 101} maps 42 to 101: allowed a mapping of token ids to "
         "numbers in [-100, 100]"),
        ({"x": 1}, "logit_bias={'x': 1} has the key 'x', not a token id"),
        ({42: float("nan")}, "logit_bias={42: nan} maps 42 to nan"),
        ([42], "logit_bias=[42] is a list: allowed a mapping"),
    ],
)  # fmt: skip
def test_bad_biases_are_refused(bias, message):
    with pytest.raises(InvalidInputError) as info:
        SamplingParams(logit_bias=bias)
    assert str(info.value).startswith(message)


def test_a_token_past_the_vocabulary_is_refused(llm):
    with pytest.raises(InvalidInputError, match=r"logit_bias=\[5000\] holds 5000"):
        llm.generate([[1]], greedy(logit_bias={5000: 1}))
