"""Tool calls and JSON-schema answers from the real Qwen2.5-Coder-0.5B-Instruct behind
`nanoqwen serve`, through the official openai client: every answer to a set of schemas
validates, required and named tool choices give valid calls, an unconstrained call without
its tags is read as one, streamed calls assemble to the whole response's, and a conversation
with a tool result goes on to a text answer."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from openai import OpenAI
from test_structured_output_real import PERSON

from .serve_harness import Server

pytestmark = pytest.mark.real_model
pytest.importorskip("xgrammar")

SCHEMAS = {
    "person": ("Describe a software engineer called Ana, 31, who writes Python and Rust.", PERSON),
    "order": ("An order of two books for Bob in Oslo, paid by card.", {
        "type": "object",
        "properties": {
            "customer": {"type": "object", "properties": {
                "name": {"type": "string", "minLength": 1},
                "address": {"type": "object", "properties": {
                    "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{4}$"}},
                    "required": ["city", "zip"]}},
                "required": ["name", "address"]},
            "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
                "type": "object", "properties": {
                    "title": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
                    "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000}},
                "required": ["title", "quantity", "price"]}},
            "payment": {"enum": ["card", "cash", "invoice"]},
            "gift": {"type": "boolean"},
        },
        "required": ["customer", "items", "payment"],
    }),
    "methods": ("List three HTTP methods and whether each is idempotent.", {
        "type": "array", "minItems": 3, "maxItems": 3,
        "items": {"type": "object", "properties": {
            "method": {"type": "string", "pattern": "^[A-Z]{3,7}$"},
            "idempotent": {"type": "boolean"}},
            "required": ["method", "idempotent"], "additionalProperties": False},
    }),
    "sentiment": ("Classify the sentiment of: 'The build finally passes!'", {
        "type": "object",
        "properties": {"sentiment": {"enum": ["positive", "neutral", "negative"]},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["sentiment", "confidence"],
    }),
}  # fmt: skip
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city name"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the Python documentation",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer",
                           "minimum": 1, "maximum": 20}},
            "required": ["query", "limit"],
        },
    },
}  # fmt: skip
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}
ASK = [{"role": "user", "content": "What is the weather like in Paris today, in celsius?"}]


@pytest.fixture(scope="module")
def server(real_model_dir, tmp_path_factory):
    server = Server(["--device", "cpu"], tmp_path_factory.mktemp("serve") / "tools.log")
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_every_json_schema_answer_validates(client):
    def ask(item):
        name, (prompt, schema) = item
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        return client.chat.completions.create(
            model=None, messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
            response_format=fmt, temperature=0, max_tokens=200,
        )  # fmt: skip

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # one batch in the engine
        answers = list(pool.map(ask, SCHEMAS.items()))
    for (_, schema), answer in zip(SCHEMAS.values(), answers):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
    person = json.loads(answers[0].choices[0].message.content)
    assert person["name"].startswith("Ana") and person["age"] == 31


def test_json_object_and_regex(client):
    obj = client.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "The capital of France, as JSON."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=80,
    ).choices[0]  # fmt: skip
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.message.content), dict)
    phone = client.completions.create(
        model=None, prompt="A phone number: ", max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}},
    ).choices[0]  # fmt: skip
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", phone.text) and phone.finish_reason == "stop"


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def streamed(client, **request) -> tuple[list[dict], str, str]:
    """(calls assembled from the deltas, content, finish reason) of a streamed request."""
    calls: dict[int, dict] = {}
    content, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **request):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            if piece.id:
                assert call["id"] is None  # the id comes once, with the name
                call["id"], call["name"] = piece.id, piece.function.name
            call["arguments"] += piece.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return [calls[i] for i in sorted(calls)], content, reason


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "search_docs"}}]
)
def test_forced_calls_are_valid_and_streaming_assembles_the_same_call(client, tool_choice):
    request = dict(model=None, messages=ASK, tools=[WEATHER, SEARCH], tool_choice=tool_choice,
                   temperature=0, max_tokens=120)  # fmt: skip
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    calls = calls_of(whole.message)
    assert calls
    for name, arguments in calls:
        jsonschema.validate(arguments, PARAMETERS[name])
    if tool_choice != "required":
        assert [name for name, _ in calls] == ["search_docs"]
    else:
        assert calls[0] == ("get_weather", {"city": "Paris", "unit": "celsius"})
    pieces, content, reason = streamed(client, **request)
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in pieces] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in pieces)


@pytest.mark.parametrize("tools", [[WEATHER], [WEATHER, SEARCH]], ids=["bare", "fenced"])
def test_auto_reads_a_call_the_model_writes_without_its_tags(client, tools):
    """Unconstrained, this model writes the call as a bare object (one tool) or in a ```json
    fence (two), not in <tool_call> tags; it is read as the call all the same."""
    request = dict(model=None, messages=ASK, tools=tools, temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert calls_of(whole.message) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    pieces, content, reason = streamed(client, **request)
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in pieces] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]


def test_a_tool_result_leads_to_a_text_answer(client):
    first = client.chat.completions.create(
        model=None, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
        max_tokens=80,
    ).choices[0].message  # fmt: skip
    call = first.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"temperature": 18, "condition": "sunny"})},
    ]  # fmt: skip
    answer = client.chat.completions.create(
        model=None, messages=history, tools=[WEATHER], temperature=0, max_tokens=60
    ).choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "18" in answer.message.content
