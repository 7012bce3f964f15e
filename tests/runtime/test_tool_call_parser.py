"""Qwen2.5's <tool_call> blocks read out of an answer: streamed in any pieces, the calls are
the whole answer's to the byte; what is not a call stays content."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoqwen.runtime.chat.tool_calls import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCallParser,
    assemble,
    parse_tool_calls,
)

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TRICKY = (
    '<tool_call>\n{"name": "run", "arguments": {"code": "print(\\"}</tool_call>\\")", '
    '"n": [1, {"x": []}]}}\n</tool_call>'
)
ANSWERS = [
    "Just text, no call.",
    WEATHER,
    "Let me look.\n" + WEATHER,
    WEATHER + "\n" + TRICKY,
    '<tool_call>\n{"arguments": {"a": 1}, "name": "reordered"}\n</tool_call>',
    "<tool_call>\nnot a call</tool_call> and text",
    '<tool_call>\n{"name": "cut", "arguments": {"a": [1, 2',
    '<tool_call>\n{"name": "cu',
    "ends with <tool_",
]


def calls(text: str) -> tuple[str, list[tuple[str, str]]]:
    content, found = parse_tool_calls(text)
    return content, [(c.name, c.arguments) for c in found]


@pytest.mark.parametrize(
    ("text", "content", "found"),
    [
        ("Just text, no call.", "Just text, no call.", []),
        (WEATHER, "", [("get_weather", '{"city": "Paris"}')]),
        ("Let me look.\n" + WEATHER, "Let me look.\n", [("get_weather", '{"city": "Paris"}')]),
        (WEATHER + "\n" + TRICKY, "",
         [("get_weather", '{"city": "Paris"}'),
          ("run", '{"code": "print(\\"}</tool_call>\\")", "n": [1, {"x": []}]}')]),
        ('<tool_call>\n{"arguments": {"a": 1}, "name": "reordered"}\n</tool_call>', "",
         [("reordered", '{"a": 1}')]),
        ('<tool_call>\n{"name": "scalar", "arguments": 5}\n</tool_call>', "", [("scalar", "5")]),
        ("<tool_call>\nnot a call</tool_call> and text",
         "<tool_call>\nnot a call</tool_call> and text", []),
        # Cut off by max_tokens: arguments as far as they got; before the name, plain text.
        ('<tool_call>\n{"name": "cut", "arguments": {"a": [1, 2', "", [("cut", '{"a": [1, 2')]),
        ('<tool_call>\n{"name": "cu', '<tool_call>\n{"name": "cu', []),
        ("ends with <tool_", "ends with <tool_", []),
    ],
)  # fmt: skip
def test_calls_and_content_of_an_answer(text, content, found):
    assert calls(text) == (content, found)


@settings(max_examples=200, deadline=None)
@given(answer=st.sampled_from(ANSWERS), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_any_pieces_give_the_whole_answers_calls(answer, cuts):
    parser = ToolCallParser()
    events = []
    bounds = sorted({min(c, len(answer)) for c in cuts} | {0, len(answer)})
    for a, b in zip(bounds, bounds[1:]):
        events += parser.feed(answer[a:b])
    events += parser.finish()
    content, found = assemble(events)
    assert (content, [(c.name, c.arguments) for c in found]) == calls(answer)


def test_the_name_streams_before_the_arguments_end():
    parser = ToolCallParser()
    events = parser.feed('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [type(e) for e in events] == [ContentDelta, CallStart, ArgumentsDelta]
    assert events[0].text == "Sure."
    assert (events[1].index, events[1].name) == (0, "get_weather")
    assert events[1].id.startswith("call_") and len(events[1].id) == 29
    assert events[2].text == '{"ci'
    rest = parser.feed('ty": "Paris"}}\n</tool_call>') + parser.finish()
    assert rest == [ArgumentsDelta(0, 'ty": "Paris"}')]


def test_text_that_may_open_a_call_is_held_back_until_it_does_not():
    parser = ToolCallParser()
    assert parser.feed("a <tool") == [ContentDelta("a ")]
    assert parser.feed("box") == [ContentDelta("<toolbox")]
