"""SamplingParams: documented defaults, and one-line ValueErrors for every invalid value."""

from __future__ import annotations

import dataclasses
import re

import pytest

from nanoqwen import SamplingParams


def test_defaults_are_the_documented_ones():
    documented = SamplingParams(
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        max_tokens=16,
        min_tokens=0,
        stop=None,
        stop_token_ids=None,
        ignore_eos=False,
        seed=None,
    )
    default = SamplingParams()
    assert default == documented
    values = {f.name: getattr(default, f.name) for f in dataclasses.fields(default) if f.init}
    assert values == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": 16,
        "min_tokens": 0,
        "stop": None,
        "stop_token_ids": [],  # None is normalized to an empty list
        "ignore_eos": False,
        "seed": None,
    }
    assert default.stop_strings == ()
    assert not default.greedy
    assert not default.needs_penalties


# (field, invalid value, text that must name the allowed range)
INVALID = [
    ("temperature", -0.5, ">= 0 (0 = greedy)"),
    ("temperature", float("nan"), ">= 0 (0 = greedy)"),
    ("top_p", 0.0, "0 < top_p <= 1"),
    ("top_p", -0.1, "0 < top_p <= 1"),
    ("top_p", 1.5, "0 < top_p <= 1"),
    ("top_k", 0, "-1 (off) or >= 1"),
    ("top_k", -2, "-1 (off) or >= 1"),
    ("min_p", -0.01, "0 <= min_p <= 1"),
    ("min_p", 1.01, "0 <= min_p <= 1"),
    ("repetition_penalty", 0.0, "> 0"),
    ("repetition_penalty", -1.0, "> 0"),
    ("presence_penalty", -2.5, "-2 <= value <= 2"),
    ("presence_penalty", 2.01, "-2 <= value <= 2"),
    ("frequency_penalty", -2.01, "-2 <= value <= 2"),
    ("frequency_penalty", 3.0, "-2 <= value <= 2"),
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", -3, ">= 1"),
    ("min_tokens", -1, "0 <= min_tokens <= max_tokens (16)"),
    ("min_tokens", 17, "0 <= min_tokens <= max_tokens (16)"),
    ("seed", -1, "0 <= seed < 2**63"),
    ("seed", 2**63, "0 <= seed < 2**63"),
]


@pytest.mark.parametrize(("name", "value", "allowed"), INVALID)
def test_invalid_value_names_parameter_value_and_range(name, value, allowed):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{name: value})
    message = str(info.value)
    assert "\n" not in message
    assert re.match(rf"{name}={re.escape(repr(value))} ", message), message
    assert message.endswith(f"allowed {allowed}"), message


def test_min_tokens_above_a_given_max_tokens_names_both():
    with pytest.raises(ValueError, match=r"^min_tokens=9 .*max_tokens \(8\)"):
        SamplingParams(max_tokens=8, min_tokens=9)
    assert SamplingParams(max_tokens=8, min_tokens=8).min_tokens == 8


@pytest.mark.parametrize("stop", ["", ["ok", ""]])
def test_empty_stop_string_is_refused(stop):
    with pytest.raises(ValueError) as info:
        SamplingParams(stop=stop)
    message = str(info.value)
    assert message.startswith(f"stop={stop!r} ")
    assert "non-empty strings" in message


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(temperature=1e-4),
        dict(top_p=1e-9),
        dict(top_k=1),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(repetition_penalty=1e-3),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(presence_penalty=2.0, frequency_penalty=-2.0),
        dict(max_tokens=1),
        dict(seed=0),
        dict(seed=2**63 - 1),
    ],
)
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_stop_and_stop_token_ids_are_normalized():
    assert SamplingParams(stop="###").stop_strings == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ("a", "bc")
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert SamplingParams(presence_penalty=0.5).needs_penalties
    assert SamplingParams(frequency_penalty=-0.5).needs_penalties
