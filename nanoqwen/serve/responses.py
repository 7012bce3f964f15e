"""Engine output -> OpenAI response bodies: what completions and chat completions share (ids,
usage, logprobs, the event stream and its hand-written chunks), and /v1/completions' bodies.
Chat's are in chat_responses.py."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from json.encoder import encode_basestring

from nanoqwen.runtime.logprobs import TokenLogprobs
from nanoqwen.serve.engine_client import ChoiceOutput
from nanoqwen.serve.errors import APIError, error_body
from nanoqwen.serve.generation import Generation
from nanoqwen.serve.protocol import (
    ChatCompletionChunk,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)

DONE = "data: [DONE]\n\n"
# A str as a JSON string, as json.dumps(text, ensure_ascii=False) and pydantic write it: the C
# function json.dumps calls, without dumps' ~1 µs of set-up per call.
json_string = encode_basestring
_REASONS = {None: "null", "stop": '"stop"', "length": '"length"'}
TokenText = Callable[[int], str]  # a token id's own text, for logprobs


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(gen: Generation, completion_tokens: int, cached: dict[int, int | None]) -> Usage:
    """cached: each choice's prompt tokens from the prefix cache (a prompt counts once, by
    its first choice, however many choices it has)."""
    prompt_tokens = sum(gen.prompt_lens)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(cached.get(i) or 0 for i in gen.first_choices)
        ),
    )


def whole_usage(gen: Generation, outputs: list[ChoiceOutput]) -> Usage:
    completion_tokens = sum(len(o.token_ids) for o in outputs)
    return usage(gen, completion_tokens, {i: o.cached_tokens for i, o in enumerate(outputs)})


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
        out.top_logprobs.append(None if e.top is None else {token_text(t): lp for t, lp in e.top})
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
        usage=whole_usage(gen, outputs),
    )


def completion_stream(
    gen: Generation,
    model: str,
    token_text: TokenText,
    return_token_ids: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    base = dict(id=new_id("cmpl"), created=int(time.time()), model=model)
    encode = ChunkEncoder(CompletionChunk(**base, choices=[]), include_usage)
    offsets = [0] * gen.num_choices  # characters each choice sent: its logprobs' text_offset

    def event(i: int, part: ChoiceOutput, ids: list[int] | None) -> str:
        offset = offsets[i]
        offsets[i] += len(part.text)
        if part.logprobs is None:
            return encode.completion(i, part.text, part.finish_reason, ids)
        logprobs = completion_logprobs(part.logprobs, token_text, offset)
        choice = CompletionChoice(
            index=i, text=part.text, logprobs=logprobs, finish_reason=part.finish_reason,
            token_ids=ids,
        )  # fmt: skip
        return encode.model(CompletionChunk(**base, choices=[choice]))

    return event_stream(gen, CompletionChunk, base, return_token_ids, include_usage, event)


async def event_stream(
    gen: Generation,
    chunk: type[CompletionChunk] | type[ChatCompletionChunk],
    base: dict,
    return_token_ids: bool,
    include_usage: bool,
    event: Callable[[int, ChoiceOutput, list[int] | None], str],
    opening: Callable[[], str] | None = None,
) -> AsyncIterator[str]:
    """The events of one stream: opening()'s, then event(choice, part, token ids) for each
    part a client can see, batched per delivery; then usage and [DONE]."""
    completion_tokens = 0
    cached: dict[int, int | None] = {}
    try:
        # Started here, not in the handler: a client gone before the stream begins then costs
        # nothing (a generator that never ran has no `finally` to abort it).
        gen.start()
        if opening is not None:
            yield opening()
        while gen.unfinished:
            events = []
            for i, part in (await gen.next_batch()).items():
                completion_tokens += len(part.token_ids)
                if part.cached_tokens is not None:
                    cached[i] = part.cached_tokens
                ids = part.token_ids if return_token_ids else None
                if part.text or part.finish_reason or ids or part.logprobs:
                    events.append(event(i, part, ids))
                # else nothing a client can see (text held back for UTF-8 or a stop string)
            if events:
                yield "".join(events)
    except APIError as e:  # the engine failed mid-stream: the status line went out already
        yield sse(error_body(e.status, e.message))
        yield DONE
        return
    finally:
        gen.abort()
    if include_usage:
        yield sse(chunk(**base, choices=[], usage=usage(gen, completion_tokens, cached)))
    yield DONE


class ChunkEncoder:
    """Server-sent events of one stream's chunks, written by hand on the hot path (one per
    choice per delivery) and byte for byte what the pydantic models give
    (tests/serve/test_serve_protocol.py checks it): building and dumping the models costs
    ~20 µs a chunk, this ~2."""

    def __init__(self, empty: CompletionChunk | ChatCompletionChunk, include_usage: bool):
        self.exclude = None if include_usage else {"usage"}
        head = empty.model_dump_json(exclude={"choices", "usage"})  # {"id":...,"model":"m"}
        self.head = f'data: {head[:-1]},"choices":[{{"index":'
        self.tail = ',"usage":null}\n\n' if include_usage else "}\n\n"

    def model(self, chunk: CompletionChunk | ChatCompletionChunk) -> str:
        return f"data: {chunk.model_dump_json(exclude=self.exclude)}\n\n"

    @staticmethod
    def _rest(finish_reason: str | None, token_ids: list[int] | None) -> str:
        reason = _REASONS.get(finish_reason) or json_string(finish_reason)
        ids = "" if token_ids is None else f',"token_ids":[{",".join(map(str, token_ids))}]'
        return f'"logprobs":null,"finish_reason":{reason}{ids}}}]'

    def completion(self, index, text: str, finish_reason, token_ids) -> str:
        rest = self._rest(finish_reason, token_ids)
        return f'{self.head}{index},"text":{json_string(text)},{rest}{self.tail}'

    def chat(self, index, text: str, finish_reason, token_ids) -> str:
        rest = self._rest(finish_reason, token_ids)
        return f'{self.head}{index},"delta":{{"content":{json_string(text)}}},{rest}{self.tail}'
