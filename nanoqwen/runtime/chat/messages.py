"""OpenAI-style chat messages, checked, as the checkpoint's chat template reads them.

Roles system (or OpenAI's newer name developer), user, assistant and tool. An assistant
message may carry tool_calls (arguments as JSON text, as OpenAI sends them; the template
writes them as an object); each tool message answers one of the calls of the assistant
message before it, by tool_call_id."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from nanoqwen.errors import InvalidInputError
from nanoqwen.validation import a_type, invalid

ROLES = ("system", "developer", "user", "assistant", "tool")


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as dicts for the template: content as text, developer as system,
    tool-call arguments parsed. InvalidInputError names the message and field to blame."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise invalid("messages", messages, f"is {a_type(messages)}", "a list of messages")
    if not messages:
        raise InvalidInputError("messages is empty: at least one message is needed", "messages")
    out = []
    unanswered: dict[str, str] = {}  # call id -> function name, of the last assistant message
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise invalid(where, message, f"is {a_type(message)}", "an object with a role")
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role", role, "is not a role", ", ".join(ROLES))
        content = _text(message.get("content"), f"{where}.content", role)
        if role == "tool":
            out.append({"role": "tool", "content": content})
            _answer(message.get("tool_call_id"), unanswered, where)
            continue
        unanswered = {}
        if role != "assistant":
            out.append({"role": "system" if role == "developer" else role, "content": content})
            continue
        entry: dict[str, Any] = {"role": "assistant", "content": content}
        calls = message.get("tool_calls") or []
        if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
            raise invalid(f"{where}.tool_calls", calls, f"is {a_type(calls)}", "a list of calls")
        if calls:
            made = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
            entry["tool_calls"] = made
            unanswered = {c["id"]: c["function"]["name"] for c in made}
        out.append(entry)
    return out


def _text(content: Any, where: str, role: str) -> str:
    """A message's content as text: a string, text parts joined, or (for an assistant message
    that only calls tools) nothing."""
    if content is None and role == "assistant":
        return ""
    if isinstance(content, str):
        return content
    allowed = "a string or a list of text parts"
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise invalid(f"{where}[{j}]", part, "is not a text part", '{"type": "text", ...}')
            if not isinstance(part.get("text"), str):
                raise invalid(f"{where}[{j}].text", part.get("text"), "is not a string", "a string")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(where, content, f"is {a_type(content)}", allowed)


def _call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise invalid(where, call, f"is {a_type(call)}", "an object with id and function")
    if call.get("type", "function") != "function":
        raise invalid(f"{where}.type", call.get("type"), "is not a call type", "function")
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where}.id", call_id, "is not a call id", "a non-empty string")
    function = call.get("function")
    if not isinstance(function, Mapping):
        raise invalid(f"{where}.function", function, "is missing", "an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.function.name", name, "is not a name", "a non-empty string")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            raise InvalidInputError(
                f"{where}.function.arguments is not JSON text ({e})",
                param=f"{where}.function.arguments",
            ) from None
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _answer(call_id: Any, unanswered: dict[str, str], where: str) -> None:
    """Marks the call a tool message answers; refuses one that answers none."""
    if not unanswered:
        raise InvalidInputError(
            f"{where} is a tool result with no tool call to answer: a tool message follows an "
            "assistant message with tool_calls (or another tool message)",
            param=where,
        )
    if call_id not in unanswered:
        raise invalid(f"{where}.tool_call_id", call_id, "matches no unanswered call of the "
                      "assistant message before it", ", ".join(map(repr, unanswered)))  # fmt: skip
    del unanswered[call_id]
