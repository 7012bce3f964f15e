"""Structured output (SamplingParams.structured_output): whatever the weights, the text is in
the language asked for: a JSON schema's documents, a regex's matches, a grammar's sentences.
On the tiny random model, whose unconstrained text is noise."""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import pytest

from nanoqwen import LLM, InvalidInputError, SamplingParams
from nanoqwen.runtime.sampling.structured import StructuredOutput

pytest.importorskip("xgrammar")

# Closed: no free-form strings, so a random model ends every document within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["color", "n", "ok", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model[0]), num_kv_blocks=64, block_size=16, progress=False)


def sampled(**params) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=80, **params)


def test_every_output_is_a_document_of_the_schema(llm):
    params = [sampled(seed=s, structured_output={"json": SCHEMA}) for s in range(8)]
    outs = llm.generate([[5 + s, 9, 11] for s in range(8)], params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs}) > 1  # sampled, not one forced string


def test_regex_and_grammar_outputs_are_in_their_language(llm):
    regex = sampled(seed=1, structured_output=StructuredOutput(regex=r"[ab]{3}-\d{2}"))
    grammar = sampled(seed=2, structured_output={"grammar": 'root ::= "yes" | "no" | "maybe"'})
    text_regex, text_grammar = (o.text for o in llm.generate([[1, 2], [3, 4]], [regex, grammar]))
    assert re.fullmatch(r"[ab]{3}-\d{2}", text_regex), text_regex
    assert text_grammar in ("yes", "no", "maybe")


def test_constrained_and_free_requests_share_a_batch(llm):
    """A constrained neighbour changes nothing about a free request's tokens."""
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[7, 8, 9]], free)[0].token_ids
    together = llm.generate(
        [[7, 8, 9], [4, 5]], [free, sampled(seed=4, structured_output={"json": SCHEMA})]
    )
    assert together[0].token_ids == alone
    jsonschema.validate(json.loads(together[1].text), SCHEMA)


def test_streamed_text_is_the_same_document(llm):
    params = sampled(seed=5, structured_output={"json": SCHEMA})
    whole = llm.generate([[6, 6]], params)[0].text
    streamed = "".join(chunk.text for chunk in llm.stream([[6, 6]], params))
    assert streamed == whole


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"json": {"type": "object"}, "regex": "a"},
         "structured_output sets json, regex: allowed exactly one of json, json_object, regex, "
         "grammar"),
        ({}, "structured_output sets nothing: allowed exactly one of"),
        ({"jsonschema": {}}, "unknown structured_output field 'jsonschema'"),
        ({"json": 5}, "structured_output.json=5 is an int: allowed a JSON schema"),
        ({"regex": ""}, "structured_output.regex='' is not a non-empty string"),
        ("json", "structured_output='json' is a str: allowed None, a StructuredOutput"),
    ],
)  # fmt: skip
def test_bad_specs_are_refused_when_the_params_are_made(spec, message):
    with pytest.raises(InvalidInputError) as info:
        SamplingParams(structured_output=spec)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"json": '{"type": "object", "properties": '},
         "structured_output.json cannot be compiled: the text is not JSON (Expecting value: "
         "line 1 column 34 (char 33))"),
        ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}},
         "structured_output.json.properties.a.type is not a valid JSON schema: 'no-such-type' "
         "is not valid under any of the given schemas"),
        ({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}},
         "structured_output.json cannot be compiled: Cannot find field '$defs' in "
         "#/$defs/nowhere"),
        ({"json": {"type": "array", "items": {"type": "string", "not": {"const": "x"}}}},
         "structured_output.json.items.not: `not` (a negated schema) cannot be enforced while "
         "decoding"),
        ({"json": {"properties": {"tags": {"type": "array", "uniqueItems": True}}}},
         "structured_output.json.properties.tags.uniqueItems: `uniqueItems` (items that differ "
         "from each other) cannot be enforced"),
        ({"json": {"anyOf": [{"type": "number", "multipleOf": 0.5}]}},
         "structured_output.json.anyOf[0].multipleOf: `multipleOf` on a non-integer number"),
        ({"regex": "(unclosed"},
         "structured_output.regex cannot be compiled: Regex parsing error at position 10: The "
         "parenthesis is not closed."),
        ({"grammar": "root ::= undefined_rule"},
         "structured_output.grammar cannot be compiled: "),
    ],
)  # fmt: skip
def test_a_spec_that_cannot_be_enforced_is_refused_with_the_part_to_blame(spec, message):
    with pytest.raises(InvalidInputError) as info:
        SamplingParams(structured_output=spec)
    assert str(info.value).startswith(message)
    assert info.value.param == f"structured_output.{next(iter(spec))}"


def test_an_engine_without_a_tokenizer_says_so():
    llm = LLM(random_shape="0.5B", num_kv_blocks=4, block_size=16, progress=False,
              swap_space=0)  # fmt: skip
    with pytest.raises(InvalidInputError, match="structured_output needs the model's tokenizer"):
        llm.generate([[1, 2], [3]], [SamplingParams(), sampled(structured_output={"regex": "a+"})])
    assert not llm.scheduler.waiting and not llm.scheduler.running  # nothing left queued


def test_without_xgrammar_a_constrained_request_says_what_to_install(tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` fails
    llm = LLM(str(tiny_model[0]), num_kv_blocks=8, block_size=16, progress=False)
    with pytest.raises(InvalidInputError) as info:
        sampled(structured_output={"regex": "a+"})
    assert str(info.value) == (
        "structured_output needs xgrammar, which is not installed: "
        "pip install 'nanoqwen[structured]'"
    )
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids
