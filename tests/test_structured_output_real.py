"""Structured output with the real Qwen2.5-Coder-0.5B-Instruct on the CPU: every answer to a
set of JSON schemas (nested objects, arrays, enums, required fields, bounded numbers, strings
with patterns) parses and validates, and the answers are the model's, not filler."""

from __future__ import annotations

import json

import jsonschema
import pytest

from nanoqwen import LLM, SamplingParams

pytestmark = pytest.mark.real_model
pytest.importorskip("xgrammar")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "languages": {"type": "array", "items": {"enum": ["python", "rust", "go"]},
                      "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "email", "languages"],
    "additionalProperties": False,
}  # fmt: skip
CASES = [
    ("Describe a software engineer called Ana, 31, who writes Python and Rust.", PERSON),
    (
        "Give the bounding box of a 640x480 image's left half.",
        {
            "type": "object",
            "properties": {
                "box": {
                    "type": "object",
                    "properties": {k: {"type": "number", "minimum": 0, "maximum": 640}
                                   for k in ("x0", "y0", "x1", "y1")},
                    "required": ["x0", "y0", "x1", "y1"],
                    "additionalProperties": False,
                },
                "unit": {"enum": ["px", "percent"]},
            },
            "required": ["box", "unit"],
            "additionalProperties": False,
        },
    ),
    (
        "List three HTTP methods and whether each is idempotent.",
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "method": {"type": "string", "pattern": "^[A-Z]{3,7}$"},
                    "idempotent": {"type": "boolean"},
                },
                "required": ["method", "idempotent"],
                "additionalProperties": False,
            },
            "minItems": 3,
            "maxItems": 3,
        },
    ),
    (
        "Classify the sentiment of: 'The build finally passes!'",
        {
            "type": "object",
            "properties": {
                "sentiment": {"enum": ["positive", "neutral", "negative"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["sentiment", "confidence"],
            "additionalProperties": False,
        },
    ),
]  # fmt: skip


@pytest.fixture(scope="module")
def llm(real_model_dir):
    return LLM(str(real_model_dir), device="cpu", progress=False)


def chat(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text + " Answer in JSON."}])


def test_every_answer_validates_against_its_schema(llm):
    params = [
        SamplingParams(temperature=0, max_tokens=160, structured_output={"json": schema})
        for _, schema in CASES
    ]
    outs = llm.generate([chat(llm, prompt) for prompt, _ in CASES], params)
    for out, (_, schema) in zip(outs, CASES):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    # Properties come in the schema's order.
    assert list(json.loads(outs[0].text)) == list(PERSON["properties"])
    person = json.loads(outs[0].text)
    assert person["name"].startswith("Ana") and person["age"] == 31
    assert "python" in person["languages"]
    assert json.loads(outs[3].text)["sentiment"] == "positive"


def test_json_object_mode_gives_an_object(llm):
    out = llm.generate(
        [chat(llm, "Give the capital of France and its population.")],
        SamplingParams(temperature=0, max_tokens=120, structured_output={"json_object": True}),
    )[0]
    assert out.finish_reason == "stop", out.text
    assert isinstance(json.loads(out.text), dict)
