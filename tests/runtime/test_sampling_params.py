"""SamplingParams: the README's defaults, and one InvalidInputError line for every invalid
value, whatever its type."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import readme_signature

from nanoqwen import InvalidInputError, SamplingParams


def test_defaults_are_the_ones_the_readme_documents():
    default = SamplingParams()
    fields = {f.name: getattr(default, f.name) for f in dataclasses.fields(default) if f.init}
    documented = readme_signature("SamplingParams")
    assert list(documented) == list(fields)
    assert SamplingParams(**documented) == default
    assert default.stop_strings == () and default.stop_token_ids == []
    assert not default.greedy and not default.needs_penalties


# (field, invalid value, the problem, what the message says is allowed)
INVALID = [
    ("temperature", -0.5, "is out of range", "a number >= 0 (0 = greedy)"),
    ("temperature", float("nan"), "is out of range", "a number >= 0 (0 = greedy)"),
    ("temperature", float("inf"), "is out of range", "a number >= 0 (0 = greedy)"),
    ("temperature", "hot", "is not a number", "a number >= 0 (0 = greedy)"),
    ("temperature", None, "is not a number", "a number >= 0 (0 = greedy)"),
    ("temperature", True, "is not a number", "a number >= 0 (0 = greedy)"),
    ("top_p", 0.0, "is out of range", "a number in (0, 1]"),
    ("top_p", -0.1, "is out of range", "a number in (0, 1]"),
    ("top_p", 1.5, "is out of range", "a number in (0, 1]"),
    ("top_p", [0.5], "is not a number", "a number in (0, 1]"),
    ("top_k", 0, "is out of range", "-1 (off) or an integer >= 1"),
    ("top_k", -2, "is out of range", "-1 (off) or an integer >= 1"),
    ("top_k", 2.5, "is not an integer", "-1 (off) or an integer >= 1"),
    ("top_k", 20.0, "is not an integer", "-1 (off) or an integer >= 1"),
    ("min_p", -0.01, "is out of range", "a number in [0, 1]"),
    ("min_p", 1.01, "is out of range", "a number in [0, 1]"),
    ("repetition_penalty", 0.0, "is out of range", "a number > 0 (1 = off)"),
    ("repetition_penalty", -1.0, "is out of range", "a number > 0 (1 = off)"),
    ("presence_penalty", -2.5, "is out of range", "a number in [-2, 2]"),
    ("presence_penalty", 2.01, "is out of range", "a number in [-2, 2]"),
    ("frequency_penalty", -2.01, "is out of range", "a number in [-2, 2]"),
    ("frequency_penalty", "0", "is not a number", "a number in [-2, 2]"),
    ("max_tokens", 0, "is out of range", "an integer >= 1"),
    ("max_tokens", -3, "is out of range", "an integer >= 1"),
    ("max_tokens", 1.5, "is not an integer", "an integer >= 1"),  # gave 2 tokens
    ("max_tokens", True, "is not an integer", "an integer >= 1"),  # gave 1 token
    ("max_tokens", None, "is not an integer", "an integer >= 1"),
    ("min_tokens", -1, "is out of range", "an integer from 0 to max_tokens (16)"),
    ("min_tokens", 17, "is out of range", "an integer from 0 to max_tokens (16)"),
    ("seed", -1, "is out of range", "None or an integer from 0 to 2**63 - 1"),
    ("seed", 2**63, "is out of range", "None or an integer from 0 to 2**63 - 1"),
    ("seed", 1.5, "is not an integer", "None or an integer from 0 to 2**63 - 1"),
    ("ignore_eos", 1, "is not a bool", "True or False"),
    ("ignore_eos", "no", "is not a bool", "True or False"),
    ("logprobs", 21, "is out of range", "None or 0..20"),
    ("logprobs", -1, "is out of range", "None or 0..20"),
    ("prompt_logprobs", 2.0, "is not an integer", "None or 0..20"),
    ("stop", 123, "is an int", "None, a non-empty string or a list of them"),
    ("stop", "", "holds an empty string", "None, a non-empty string or a list of them"),
    ("stop", ["ok", ""], "holds an empty string", "None, a non-empty string or a list of them"),
    ("stop", ["ok", 5], "holds an int", "None, a non-empty string or a list of them"),
    ("stop_token_ids", [-1], "holds -1", "a list of token ids >= 0"),
    ("stop_token_ids", [1.0], "holds 1.0, not an integer", "a list of token ids >= 0"),
    ("stop_token_ids", 7, "is not a list", "a list of token ids >= 0"),
    ("stop_token_ids", "7", "is not a list", "a list of token ids >= 0"),
]


@pytest.mark.parametrize(("name", "value", "problem", "allowed"), INVALID)
def test_invalid_value_names_parameter_value_and_what_is_allowed(name, value, problem, allowed):
    with pytest.raises(InvalidInputError) as info:
        SamplingParams(**{name: value})
    assert str(info.value) == f"{name}={value!r} {problem}: allowed {allowed}"
    assert info.value.param == name
    assert isinstance(info.value, ValueError)  # the README promises a ValueError


def test_min_tokens_above_a_given_max_tokens_names_both():
    with pytest.raises(InvalidInputError, match=r"^min_tokens=9 .*max_tokens \(8\)$"):
        SamplingParams(max_tokens=8, min_tokens=9)
    assert SamplingParams(max_tokens=8, min_tokens=8).min_tokens == 8


def test_a_huge_value_is_cut_in_the_message():
    with pytest.raises(InvalidInputError) as info:
        SamplingParams(stop=["x" * 10_000, 3])
    assert len(str(info.value)) < 200


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0),
        dict(temperature=1e-4),
        dict(top_p=1e-9),
        dict(top_k=1),
        dict(min_p=1),
        dict(repetition_penalty=1e-3),
        dict(presence_penalty=-2, frequency_penalty=2),
        dict(max_tokens=1),
        dict(seed=0),
        dict(seed=2**63 - 1),
        dict(logprobs=0, prompt_logprobs=20),
    ],
)
def test_boundary_values_are_accepted_and_numbers_stored_as_floats(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        stored = getattr(params, name)
        float_field = isinstance(SamplingParams.__dataclass_fields__[name].default, float)
        # An int given for a float parameter is stored as a float, so the sampler's
        # arithmetic and the dataclass's equality see one type.
        assert type(stored) is (float if float_field else int), name
        assert stored == value


def test_stop_and_stop_token_ids_are_normalized():
    assert SamplingParams(stop="###").stop_strings == ("###",)
    assert SamplingParams(stop=("a", "bc")).stop_strings == ("a", "bc")
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert SamplingParams(presence_penalty=0.5).needs_penalties
    assert SamplingParams(frequency_penalty=-0.5).needs_penalties


# ---- from_dict: what the HTTP server builds a request's parameters with ----------------------
def test_from_dict_builds_the_same_params():
    data = {"temperature": 0, "max_tokens": 5, "stop": ["\n"], "seed": 3}
    assert SamplingParams.from_dict(data) == SamplingParams(**data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"temprature": 0.5}, "unknown sampling parameter 'temprature': allowed temperature, "),
        ({"stop_strings": ["x"]}, "unknown sampling parameter 'stop_strings'"),
        ({"max_tokens": "5"}, "max_tokens='5' is not an integer: allowed an integer >= 1"),
        (["temperature", 0], "sampling_params=['temperature', 0] is not a mapping"),
    ],
)
def test_from_dict_refusals(data, message):
    with pytest.raises(InvalidInputError) as info:
        SamplingParams.from_dict(data)
    assert str(info.value).startswith(message)
