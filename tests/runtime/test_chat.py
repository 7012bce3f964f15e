"""LLM.chat: messages with tool calls and results rendered through Qwen2.5's own template,
tool_choice required or named constraining the answer to valid calls, response_format
constraining it to a schema's documents, and every bad request refused with the field to
blame. On the tiny random model: the constraints hold whatever the weights."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from nanoqwen import LLM, InvalidInputError, SamplingParams
from nanoqwen.runtime.chat.messages import template_messages

pytest.importorskip("xgrammar")

TEMPLATE = (Path(__file__).parent / "qwen25_chat_template.jinja").read_text()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer",
                           "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                       "required": ["utc"], "additionalProperties": False},
    },
}  # fmt: skip
SCHEMAS = {
    "get_weather": WEATHER["function"]["parameters"],
    "get_time": TIME["function"]["parameters"],
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALLED = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "clear"}'},
]  # fmt: skip


@pytest.fixture(scope="module")
def llm(tiny_model):
    llm = LLM(str(tiny_model[0]), num_kv_blocks=64, block_size=16, progress=False)
    llm.tokenizer.set_chat_template(TEMPLATE, "Qwen2.5's chat template")
    return llm


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=120, seed=seed)


def test_history_with_calls_and_results_renders_as_qwen_writes_it(llm):
    text = llm.tokenizer.render_chat(template_messages(CALLED), tools=[WEATHER])
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", ' in text
    assert text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "days": 1}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"sky": "clear"}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("parallel", [True, False])
def test_required_gives_valid_calls_whatever_the_weights(llm, parallel):
    outs = llm.chat([ASK] * 4, [sampled(s) for s in range(4)], tools=[WEATHER, TIME],
                    tool_choice="required", parallel_tool_calls=parallel)  # fmt: skip
    for out in outs:
        calls = out.tool_calls
        assert calls, out.output.text
        if out.finish_reason == "length":  # random weights may call on and on
            assert parallel
            calls = calls[:-1]  # the last may be cut off
        else:
            assert out.finish_reason == "tool_calls" and out.content is None, out.output.text
            assert parallel or len(calls) == 1
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_a_named_function_is_the_one_called(llm):
    choice = {"type": "function", "function": {"name": "get_time"}}
    out = llm.chat(ASK, sampled(7), tools=[WEATHER, TIME], tool_choice=choice)[0]
    assert [c.name for c in out.tool_calls] == ["get_time"]
    assert isinstance(json.loads(out.tool_calls[0].arguments)["utc"], bool)
    assert out.content is None and out.finish_reason == "tool_calls"


def test_none_shows_no_tools_and_reads_no_calls(llm):
    prompt_none = llm.chat(ASK, sampled(1), tools=[WEATHER], tool_choice="none")[0]
    prompt_plain = llm.chat(ASK, sampled(1))[0]
    assert prompt_none.output.prompt_token_ids == prompt_plain.output.prompt_token_ids
    assert prompt_none.tool_calls == [] and prompt_none.content == prompt_none.output.text


def test_response_format_json_schema_gives_documents(llm):
    schema = SCHEMAS["get_weather"]
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    for out in llm.chat([ASK] * 3, [sampled(s) for s in range(3)], response_format=fmt):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.content), schema)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (dict(messages=[]), "messages is empty: at least one message is needed"),
        (dict(messages=[{"role": "robot", "content": "hi"}]),
         "messages[0].role='robot' is not a role: allowed system, developer, user, assistant, "
         "tool"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
         "messages[0].content[0]={'type': 'image_url'} is not a text part"),
        (dict(messages=[*ASK, {"role": "tool", "tool_call_id": "c1", "content": "18C"}]),
         "messages[1] is a tool result with no tool call to answer"),
        (dict(messages=[*CALLED[:2], {"role": "tool", "tool_call_id": "c9", "content": "x"}]),
         "messages[2].tool_call_id='c9' matches no unanswered call of the assistant message "
         "before it: allowed 'c1'"),
        (dict(messages=[*CALLED, {"role": "tool", "tool_call_id": "c1", "content": "again"}]),
         "messages[3] is a tool result with no tool call to answer"),
        (dict(messages=[ASK[0], {"role": "assistant", "tool_calls": [
            {"id": "c1", "function": {"name": "f", "arguments": "{city: Paris}"}}]}]),
         "messages[1].tool_calls[0].function.arguments is not JSON text"),
        (dict(messages=ASK, tool_choice="required"),
         "tool_choice='required' needs tools: give tools, or leave tool_choice out"),
        (dict(messages=ASK, tools=[WEATHER],
              tool_choice={"type": "function", "function": {"name": "get_tme"}}),
         "tool_choice.function.name='get_tme' is not one of the tools: allowed get_weather"),
        (dict(messages=ASK, tools=[WEATHER], tool_choice="always"),
         "tool_choice='always' is unknown: allowed none, auto, required or"),
        (dict(messages=ASK, tools=[WEATHER, WEATHER]),
         "tools[1].function.name='get_weather' names a second tool: allowed each name once"),
        (dict(messages=ASK, tools=[{"type": "function", "function": {"name": "bad name"}}]),
         "tools[0].function.name='bad name' is not a function name"),
        (dict(messages=ASK, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "txt"}}}}}]),
         "tools[0].function.parameters.properties.a.type is not a valid JSON schema"),
        (dict(messages=ASK, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "if": {"required": ["a"]}}}}]),
         "tools[0].function.parameters.if: `if` (conditional schemas (if/then/else)) cannot be "
         "enforced while decoding"),
        (dict(messages=ASK, response_format={"type": "yaml"}),
         "response_format.type='yaml' is unknown: allowed text, json_object, json_schema"),
        (dict(messages=ASK, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "array", "uniqueItems": True}}}),
         "response_format.json_schema.schema.uniqueItems: `uniqueItems`"),
        (dict(messages=ASK, tools=[WEATHER], tool_choice="required",
              response_format={"type": "json_object"}),
         "response_format and tool_choice both constrain the answer"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field_to_blame(llm, request_, message):
    with pytest.raises(InvalidInputError) as info:
        llm.chat(sampling_params=sampled(0), **request_)
    assert str(info.value).startswith(message), str(info.value)
    assert not llm.scheduler.waiting and not llm.scheduler.running
