"""Qwen2.5's tool calls read out of its text, as the text streams in.

Qwen2.5's chat template teaches the model to call a tool by writing

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(one block per call, several in a row for parallel calls). ToolCallParser turns the text into
events as OpenAI streams a message: text outside the blocks as content, and for each call its
name first, then its arguments (JSON text) in pieces as they are written. A whole answer is
parsed by feeding it at once, so a streamed answer and a whole one give the same calls, to the
byte. Given the request's tool names, an answer made of nothing but calls written without the
tags is read as those calls too (bare_calls.py)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from nanoqwen.runtime.chat.bare_calls import BareCalls

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
# The call's start as the template writes it: the name is known once this much has arrived.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it


@dataclass
class ContentDelta:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class ArgumentsDelta:
    index: int
    text: str


Event = ContentDelta | CallStart | ArgumentsDelta


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held_back(text: str, tag: str) -> int:
    """How many characters at text's end could be the start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _ValueScanner:
    """Finds where a JSON value written in pieces ends: an object or array at its closing
    bracket (strings and escapes minded), anything else at the call's closing brace."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """The index in text just past the value's end, or None while it goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                if self.depth == 0:
                    return i
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class ToolCallParser:
    """feed() each new piece of text, then finish() once: both return events in order.
    names: the request's tools, whose calls are also read without tags (bare_calls.py)."""

    def __init__(self, names: frozenset[str] = frozenset()) -> None:
        self._bare = BareCalls(names) if names else None  # while the answer may be such calls
        self._buffer = ""  # text not yet turned into events
        self._in_call = False
        self._scanner: _ValueScanner | None = None  # while a call's arguments stream
        self._arguments_done = False
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        if self._bare is not None:
            if self._bare.feed(text):
                return []
            text, self._bare = self._bare.text, None
        self._buffer += text
        events: list[Event] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(OPEN)
                if start < 0:
                    keep = _held_back(self._buffer, OPEN)
                    ready = self._buffer[: len(self._buffer) - keep]
                    if self.num_calls and ready.isspace():
                        return events  # after a call: content only if more text follows it
                    self._content(ready, events)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return events
                self._content(self._buffer[:start], events)
                self._buffer = self._buffer[start + len(OPEN) :]
                self._in_call = True
            if not self._call(events):
                return events

    def finish(self) -> list[Event]:
        """The rest: held-back text, or a call cut off before its name as plain content."""
        if self._bare is not None:
            bare, self._bare = self._bare, None
            calls = bare.calls()
            if calls is None:
                return self.feed(bare.text) + self.finish()
            events: list[Event] = []
            for name, arguments in calls:
                self._call_at_once(name, arguments, events)
            return events
        events = []
        if self._in_call and self._scanner is None:
            self._content(OPEN + self._buffer, events)
        elif not self._in_call:
            self._content(self._buffer, events)
        self._buffer = ""
        self._in_call = False
        return events

    def _content(self, text: str, events: list[Event]) -> None:
        # Between and after calls, the template's newlines are no content.
        if text and not (self.num_calls and text.isspace()):
            events.append(ContentDelta(text))

    def _call(self, events: list[Event]) -> bool:
        """Advances inside a call; True once it has closed (the buffer then holds what
        follows it)."""
        if self._scanner is None:
            head = _HEAD.match(self._buffer)
            if head is None or head.end() == len(self._buffer):
                # The name is not known yet, or the call is not in the template's form.
                end = self._buffer.find(CLOSE)
                if end < 0:
                    return False
                self._whole_call(self._buffer[:end], events)
                self._close(end)
                return True
            self._start(head.group(1), events)
            self._buffer = self._buffer[head.end() :]
            self._scanner = _ValueScanner()
        if not self._arguments_done:
            end = self._scanner.feed(self._buffer)
            text = self._buffer if end is None else self._buffer[:end]
            if text:
                events.append(ArgumentsDelta(self.num_calls - 1, text))
            self._buffer = self._buffer[len(text) :]
            if end is None:
                return False
            self._arguments_done = True
        end = self._buffer.find(CLOSE)  # past the arguments: the closing brace, then the tag
        if end < 0:
            return False
        self._close(end)
        return True

    def _start(self, name: str, events: list[Event]) -> None:
        events.append(CallStart(self.num_calls, new_call_id(), name))
        self.num_calls += 1

    def _call_at_once(self, name: str, arguments: str, events: list[Event]) -> None:
        """A call whose arguments are known whole: its start and one arguments event."""
        self._start(name, events)
        events.append(ArgumentsDelta(self.num_calls - 1, arguments))

    def _whole_call(self, body: str, events: list[Event]) -> None:
        """A call in another form than the template's: one event with all of it, or plain
        content when it is not a call at all."""
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
            self._call_at_once(call["name"], arguments, events)
        else:
            self._content(OPEN + body + CLOSE, events)

    def _close(self, end: int) -> None:
        self._buffer = self._buffer[end + len(CLOSE) :]
        self._in_call = False
        self._scanner = None
        self._arguments_done = False


def parse_tool_calls(text: str, names: frozenset[str] = frozenset()) -> tuple[str, list[ToolCall]]:
    """A whole answer's content (text outside the calls) and its calls (names: as
    ToolCallParser takes them)."""
    parser = ToolCallParser(names)
    return assemble(parser.feed(text) + parser.finish())


def assemble(events: list[Event]) -> tuple[str, list[ToolCall]]:
    content = []
    calls: list[ToolCall] = []
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, CallStart):
            calls.append(ToolCall(event.id, event.name, ""))
        else:
            calls[event.index].arguments += event.text
    return "".join(content), calls
