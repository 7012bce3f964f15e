"""Tool calls written without Qwen2.5's <tool_call> tags.

Small Qwen2.5 models often answer a request with tools by the call's object alone,
{"name": "get_weather", "arguments": {...}}, or by that object in a ```json fence, one or
more. An answer made of nothing but such objects, each naming one of the request's tools, is
read as those calls. Any other text in it leaves all of it text, as written: a model that
repeats a call and then answers has not called anything.

BareCalls holds an answer back only while it may still be such calls, so every other answer
streams as it comes; its calls are known when it ends.
"""

from __future__ import annotations

import json

FENCE = "```"
# A call's object up to its arguments, piece by piece: whitespace may stand before each.
_NAME = None
_HEAD = ("{", '"name"', ":", '"', _NAME, ",", '"arguments"', ":")
_MORE, _NO = -1, -2  # what _past gives where the text does not (yet) go on to the piece


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _past(text: str, pos: int, piece: str) -> int:
    """The position past piece, whitespace before it skipped; _MORE while all of the text
    there may begin it, _NO where it does not."""
    pos = _skip_space(text, pos)
    if text.startswith(piece, pos):
        return pos + len(piece)
    return _MORE if piece.startswith(text[pos:]) else _NO


def _may_open_call(text: str, pos: int, names: frozenset[str]) -> bool:
    """Whether text from pos, all there is so far, may be the start of a call's object (in a
    fence or not) naming one of names."""
    fenced = text.startswith("`", _skip_space(text, pos))
    pieces = [FENCE, "json"] if fenced else []
    if fenced and not text.startswith("j", _past(text, pos, FENCE)):
        pieces.pop()  # the fence's language is optional
    for piece in pieces + list(_HEAD):
        if piece is _NAME:  # no whitespace inside a string
            close = text.find('"', pos)
            if close < 0:
                return any(name.startswith(text[pos:]) for name in names)
            if text[pos:close] not in names:
                return False
            pos = close + 1
            continue
        pos = _past(text, pos, piece)
        if pos == _NO:
            return False
        if pos == _MORE:
            return True
    return True


def read_bare_calls(text: str, names: frozenset[str], ended: bool) -> list[tuple[str, str]] | None:
    """The calls (name, arguments as JSON text) that text is made of, whitespace between
    them; None once it is not made of calls. Before the answer has ended, the calls so far
    ([] while the first is still being written), or None."""
    decoder = json.JSONDecoder()
    calls: list[tuple[str, str]] = []
    pos = _skip_space(text, 0)
    while pos < len(text):
        if not _may_open_call(text, pos, names):
            return None
        fenced = text.startswith("`", pos)
        at = _past(text, pos, FENCE) if fenced else pos
        if at < 0:  # the fence is not all there yet
            return None if ended else calls
        if fenced and text.startswith("json", at):
            at += len("json")
        try:
            call, end = decoder.raw_decode(text, _skip_space(text, at))
        except ValueError:  # cut off, or not JSON: which, the rest of the answer tells
            return None if ended else calls
        if not (isinstance(call, dict) and call.get("name") in names and "arguments" in call):
            return None
        if fenced:  # the fence closes after the object
            end = _past(text, end, FENCE)
            if end == _NO or (end == _MORE and ended):
                return None
            if end == _MORE:
                return calls
        calls.append((call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
        pos = _skip_space(text, end)
    return calls if calls or not ended else None


class BareCalls:
    """An answer's text while it may be calls without tags (read_bare_calls)."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.text = ""

    def feed(self, text: str) -> bool:
        """Holds text; False once the answer is not made of calls (self.text holds it all)."""
        self.text += text
        return read_bare_calls(self.text, self.names, ended=False) is not None

    def calls(self) -> list[tuple[str, str]] | None:
        """Once the answer has ended: its calls, or None when it is not made of them."""
        return read_bare_calls(self.text, self.names, ended=True)
