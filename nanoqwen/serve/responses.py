"""Engine output -> OpenAI response bodies: whole responses and server-sent-event streams."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

from nanoqwen.runtime.logprobs import TokenLogprobs
from nanoqwen.serve.errors import APIError, error_body
from nanoqwen.serve.generation import ChoiceOutput, Generation
from nanoqwen.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    Delta,
    TopLogprob,
    Usage,
)

DONE = "data: [DONE]\n\n"
TokenText = Callable[[int], str]  # a token id's own text, for logprobs


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(gen: Generation, completion_tokens: int) -> Usage:
    prompt_tokens = sum(gen.prompt_lens)  # once per prompt, however many choices it has
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def sse(body) -> str:
    return f"data: {body.model_dump_json()}\n\n"


# ---- logprobs ---------------------------------------------------------------------------------
def completion_logprobs(
    entries: list[TokenLogprobs] | None, token_text: TokenText, offset: int
) -> CompletionLogprobs | None:
    """The legacy completions shape: parallel lists; text_offset counts from offset."""
    if entries is None:
        return None
    out = CompletionLogprobs()
    for e in entries:
        text = token_text(e.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append({token_text(t): lp for t, lp in e.top})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(entries: list[TokenLogprobs] | None, token_text: TokenText):
    if entries is None:
        return None

    def top(token_id: int, logprob: float) -> TopLogprob:
        text = token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = []
    for e in entries:
        first = top(e.token_id, e.logprob)
        alternatives = [top(t, lp) for t, lp in e.top]
        content.append(ChatTokenLogprob(**first.model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)


# ---- /v1/completions ------------------------------------------------------------------------
def completion_response(
    gen: Generation,
    outputs: list[ChoiceOutput],
    model: str,
    token_text: TokenText,
    return_token_ids: bool,
) -> CompletionResponse:
    choices = [
        CompletionChoice(
            index=i,
            text=out.text,
            logprobs=completion_logprobs(out.logprobs, token_text, 0),
            finish_reason=out.finish_reason,
            token_ids=out.token_ids if return_token_ids else None,
        )
        for i, out in enumerate(outputs)
    ]
    return CompletionResponse(
        id=new_id("cmpl"),
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=usage(gen, sum(len(o.token_ids) for o in outputs)),
    )


async def completion_stream(
    gen: Generation,
    model: str,
    token_text: TokenText,
    return_token_ids: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    base = dict(id=new_id("cmpl"), created=int(time.time()), model=model)
    exclude = None if include_usage else {"usage"}
    offsets = [0] * gen.num_choices
    completion_tokens = 0
    async for batch in _or_error_event(gen):
        events = []
        for i, part in batch.items():
            completion_tokens += len(part.token_ids)
            if not (part.text or part.finish_reason or part.token_ids and return_token_ids):
                continue  # nothing a client can see (text held back for UTF-8 or a stop string)
            choice = CompletionChoice(
                index=i,
                text=part.text,
                logprobs=completion_logprobs(part.logprobs, token_text, offsets[i]),
                finish_reason=part.finish_reason,
                token_ids=part.token_ids if return_token_ids else None,
            )
            offsets[i] += len(part.text)
            chunk = CompletionChunk(**base, choices=[choice])
            events.append(f"data: {chunk.model_dump_json(exclude=exclude)}\n\n")
        if events:
            yield "".join(events)
    if include_usage:
        yield sse(CompletionChunk(**base, choices=[], usage=usage(gen, completion_tokens)))
    yield DONE


# ---- /v1/chat/completions -----------------------------------------------------------------------
def chat_response(
    gen: Generation,
    outputs: list[ChoiceOutput],
    model: str,
    token_text: TokenText,
    return_token_ids: bool,
) -> ChatCompletionResponse:
    choices = [
        ChatChoice(
            index=i,
            message=AssistantMessage(content=out.text),
            logprobs=chat_logprobs(out.logprobs, token_text),
            finish_reason=out.finish_reason or "length",
            token_ids=out.token_ids if return_token_ids else None,
        )
        for i, out in enumerate(outputs)
    ]
    return ChatCompletionResponse(
        id=new_id("chatcmpl"),
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=usage(gen, sum(len(o.token_ids) for o in outputs)),
    )


async def chat_stream(
    gen: Generation,
    model: str,
    token_text: TokenText,
    return_token_ids: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    base = dict(id=new_id("chatcmpl"), created=int(time.time()), model=model)
    exclude = None if include_usage else {"usage"}

    def event(choice: ChatStreamChoice) -> str:
        chunk = ChatCompletionChunk(**base, choices=[choice])
        return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"

    # As OpenAI does: each choice opens with the role and empty content.
    yield "".join(
        event(ChatStreamChoice(index=i, delta=Delta(role="assistant", content="")))
        for i in range(gen.num_choices)
    )
    completion_tokens = 0
    async for batch in _or_error_event(gen):
        events = []
        for i, part in batch.items():
            completion_tokens += len(part.token_ids)
            if not (part.text or part.finish_reason or part.token_ids and return_token_ids):
                continue
            choice = ChatStreamChoice(
                index=i,
                delta=Delta(content=part.text),
                logprobs=chat_logprobs(part.logprobs, token_text),
                finish_reason=part.finish_reason,
                token_ids=part.token_ids if return_token_ids else None,
            )
            events.append(event(choice))
        if events:
            yield "".join(events)
    if include_usage:
        yield sse(ChatCompletionChunk(**base, choices=[], usage=usage(gen, completion_tokens)))
    yield DONE


async def _or_error_event(gen: Generation) -> AsyncIterator[dict[int, ChoiceOutput]]:
    """gen's batches; an engine failure mid-stream ends the stream with an error event (the
    status line went out already), as vLLM does."""
    try:
        async for batch in gen.batches():
            yield batch
    except APIError as e:
        raise _StreamError(e) from e


class _StreamError(Exception):
    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


async def with_error_events(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for event in stream:
            yield event
    except _StreamError as e:
        yield sse(error_body(e.error.status, e.error.message))
        yield DONE
