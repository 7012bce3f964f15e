"""A chat answer as OpenAI's API shapes an assistant message: content, tool calls and the
finish reason."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoqwen.runtime.chat.tool_calls import ToolCall, parse_tool_calls
from nanoqwen.runtime.outputs import RequestOutput


@dataclass
class ChatOutput:
    content: str | None  # None when the answer is tool calls only
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"  # "stop", "length" or "tool_calls"
    output: RequestOutput | None = None  # the raw answer: its text, token ids, metrics


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """An answer that ended on its own after calling tools ends for "tool_calls"."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def message_content(content: str, calls: list[ToolCall]) -> str | None:
    """Text around tool calls that is only whitespace is no content, as OpenAI sends it."""
    return None if calls and not content.strip() else content


def chat_output(output: RequestOutput, tool_names: frozenset[str]) -> ChatOutput:
    if not tool_names:
        return ChatOutput(output.text, [], output.finish_reason, output)
    content, calls = parse_tool_calls(output.text, tool_names)
    reason = finish_reason(output.finish_reason, bool(calls))
    return ChatOutput(message_content(content, calls), calls, reason, output)
