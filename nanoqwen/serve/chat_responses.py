"""Engine output -> /v1/chat/completions bodies: the whole response, and its event stream.

A request with tools has its answers' calls of them read back as tool_calls (one
ToolCallParser per choice, so a streamed answer gives the same calls as a whole one); the
content is then the text around them, and an answer that ended on its own after calling
tools ends for "tool_calls"."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from nanoqwen.runtime.chat.output import finish_reason, message_content
from nanoqwen.runtime.chat.tool_calls import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    Event,
    ToolCallParser,
    parse_tool_calls,
)
from nanoqwen.serve.engine_client import ChoiceOutput
from nanoqwen.serve.generation import Generation
from nanoqwen.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    Delta,
    FunctionCall,
    FunctionDelta,
    ToolCall,
    ToolCallDelta,
)
from nanoqwen.serve.responses import (
    ChunkEncoder,
    TokenText,
    chat_logprobs,
    event_stream,
    new_id,
    whole_usage,
)


def _message(out: ChoiceOutput, tool_names: frozenset[str]) -> tuple[AssistantMessage, str]:
    reason = out.finish_reason or "length"
    if not tool_names:
        return AssistantMessage(content=out.text), reason
    content, calls = parse_tool_calls(out.text, tool_names)
    made = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]  # fmt: skip
    message = AssistantMessage(content=message_content(content, calls), tool_calls=made or None)
    return message, finish_reason(reason, bool(calls))


def chat_response(
    gen: Generation,
    outputs: list[ChoiceOutput],
    model: str,
    token_text: TokenText,
    return_token_ids: bool,
    tool_names: frozenset[str] = frozenset(),
) -> ChatCompletionResponse:
    choices = []
    for i, out in enumerate(outputs):
        message, reason = _message(out, tool_names)
        choices.append(
            ChatChoice(
                index=i,
                message=message,
                logprobs=chat_logprobs(out.logprobs, token_text),
                finish_reason=reason,
                token_ids=out.token_ids if return_token_ids else None,
            )
        )
    return ChatCompletionResponse(
        id=new_id("chatcmpl"),
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=whole_usage(gen, outputs),
    )


def _delta(event: Event) -> Delta:
    if isinstance(event, ContentDelta):
        return Delta(content=event.text)
    if isinstance(event, CallStart):
        function = FunctionDelta(name=event.name, arguments="")
        call = ToolCallDelta(index=event.index, id=event.id, type="function", function=function)
    else:
        assert isinstance(event, ArgumentsDelta)
        call = ToolCallDelta(index=event.index, function=FunctionDelta(arguments=event.text))
    return Delta(tool_calls=[call])


def chat_stream(
    gen: Generation,
    model: str,
    token_text: TokenText,
    return_token_ids: bool,
    include_usage: bool,
    tool_names: frozenset[str] = frozenset(),
) -> AsyncIterator[str]:
    base = dict(id=new_id("chatcmpl"), created=int(time.time()), model=model)
    encode = ChunkEncoder(ChatCompletionChunk(**base, choices=[]), include_usage)
    parsers = [ToolCallParser(tool_names) for _ in range(gen.num_choices)] if tool_names else None

    def opening() -> str:  # as OpenAI does: each choice opens with the role and empty content
        return "".join(
            encode.model(ChatCompletionChunk(**base, choices=[
                ChatStreamChoice(index=i, delta=Delta(role="assistant", content=""))
            ]))
            for i in range(gen.num_choices)
        )  # fmt: skip

    def event(i: int, part: ChoiceOutput, ids: list[int] | None) -> str:
        if parsers is not None:
            return tool_event(i, part, ids)
        if part.logprobs is None:
            return encode.chat(i, part.text, part.finish_reason, ids)
        choice = ChatStreamChoice(
            index=i, delta=Delta(content=part.text),
            logprobs=chat_logprobs(part.logprobs, token_text),
            finish_reason=part.finish_reason, token_ids=ids,
        )  # fmt: skip
        return encode.model(ChatCompletionChunk(**base, choices=[choice]))

    def tool_event(i: int, part: ChoiceOutput, ids: list[int] | None) -> str:
        """One chunk per content piece or call piece; the first carries the part's token ids
        and logprobs, the last its finish reason (an empty delta when nothing else is due)."""
        parser = parsers[i]
        events = parser.feed(part.text)
        if part.finish_reason is not None:
            events += parser.finish()
        deltas = [_delta(e) for e in events]
        if not deltas and (part.finish_reason or ids or part.logprobs):
            deltas = [Delta()]
        reason = finish_reason(part.finish_reason, parser.num_calls > 0)
        chunks = []
        for j, delta in enumerate(deltas):
            first, last = j == 0, j == len(deltas) - 1
            choice = ChatStreamChoice(
                index=i, delta=delta,
                logprobs=chat_logprobs(part.logprobs, token_text) if first else None,
                finish_reason=reason if last else None, token_ids=ids if first else None,
            )  # fmt: skip
            chunks.append(encode.model(ChatCompletionChunk(**base, choices=[choice])))
        return "".join(chunks)

    return event_stream(
        gen, ChatCompletionChunk, base, return_token_ids, include_usage, event, opening
    )
