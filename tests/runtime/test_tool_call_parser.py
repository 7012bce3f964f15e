"""Qwen2.5's <tool_call> blocks read out of an answer (and, given the tool names, calls
written without the tags): streamed in any pieces, the calls are the whole answer's to the
byte; what is not a call stays content."""

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
NAMES = frozenset({"get_weather", "run"})
BARE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
FENCED = '```json\n{\n  "name": "run",\n  "arguments": {"code": "x = {}"}\n}\n```'
ECHO = BARE + '\n{"temperature": 18, "condition": "sunny"}'
BARE_ANSWERS = [
    BARE,
    " \n" + FENCED + "\n",
    BARE + "\n" + FENCED,
    WEATHER + "\n" + BARE,
    '{"name": "run", "arguments": {"a": 1}, "more": {"b": [2]}}',
    ECHO,
    FENCED + "\nDone.",
    '{"name": "other", "arguments": {}}',
    '{"city": "Paris"}',
    "```python\nprint(1)\n```",
    "Sure: " + BARE,
    '{"name": "get_wea',
    '```json\n{"name": "run", "arguments": {"a": [1',
]


def calls(text: str, names: frozenset[str] = frozenset()) -> tuple[str, list[tuple[str, str]]]:
    content, found = parse_tool_calls(text, names)
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


@settings(max_examples=300, deadline=None)
@given(
    case=st.sampled_from([(a, frozenset()) for a in ANSWERS] + [(a, NAMES) for a in BARE_ANSWERS]),
    cuts=st.lists(st.integers(0, 200), max_size=12),
)
def test_any_pieces_give_the_whole_answers_calls(case, cuts):
    answer, names = case
    parser = ToolCallParser(names)
    events = []
    bounds = sorted({min(c, len(answer)) for c in cuts} | {0, len(answer)})
    for a, b in zip(bounds, bounds[1:]):
        events += parser.feed(answer[a:b])
    events += parser.finish()
    content, found = assemble(events)
    assert (content, [(c.name, c.arguments) for c in found]) == calls(answer, names)


@pytest.mark.parametrize(
    ("text", "content", "found"),
    [
        (BARE, "", [("get_weather", '{"city": "Paris"}')]),
        (" \n" + FENCED + "\n", "", [("run", '{"code": "x = {}"}')]),
        (BARE + "\n" + FENCED, "", [("get_weather", '{"city": "Paris"}'),
                                    ("run", '{"code": "x = {}"}')]),
        # Keys after the arguments are read past, to the object's end.
        ('{"name": "run", "arguments": {"a": 1}, "more": {"b": [2]}}', "", [("run", '{"a": 1}')]),
        # After a call in tags, a bare object is text, as any text after calls is.
        (WEATHER + "\n" + BARE, "\n" + BARE, [("get_weather", '{"city": "Paris"}')]),
        # Not only calls: all of it text. So are other names, objects, fences, a cut-off call.
        (ECHO, ECHO, []),
        (FENCED + "\nDone.", FENCED + "\nDone.", []),
        ('{"name": "other", "arguments": {}}', '{"name": "other", "arguments": {}}', []),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),
        ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
        ("Sure: " + BARE, "Sure: " + BARE, []),
        ('{"name": "get_wea', '{"name": "get_wea', []),
        ('```json\n{"name": "run", "arguments": {"a": [1',
         '```json\n{"name": "run", "arguments": {"a": [1', []),
    ],
)  # fmt: skip
def test_calls_written_without_tags_are_read_given_the_tool_names(text, content, found):
    assert calls(text, NAMES) == (content, found)
    assert calls(text) == (text, []) or "<tool_call>" in text  # without names: text


def test_an_answer_that_may_be_bare_calls_is_held_back_until_it_is_or_is_not():
    parser = ToolCallParser(NAMES)
    assert parser.feed('\n{"na') == []
    assert parser.feed('me": "get_weather", "arguments": {"city": "Paris"}}\n') == []
    events = parser.finish()
    assert [type(e) for e in events] == [CallStart, ArgumentsDelta]
    assert (events[0].name, events[1].text) == ("get_weather", '{"city": "Paris"}')
    parser = ToolCallParser(NAMES)
    assert parser.feed('{"') == []
    assert parser.feed('city": 1}') == [ContentDelta('{"city": 1}')]
    parser = ToolCallParser(NAMES)
    assert parser.feed(BARE) == []
    assert parser.feed("\nIt is") == [ContentDelta(BARE + "\nIt is")]
