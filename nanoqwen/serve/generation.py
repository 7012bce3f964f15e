"""One API request's choices as they run in the engine loop, seen from its HTTP handler."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request

from nanoqwen.runtime.engine import StreamChunk
from nanoqwen.runtime.logprobs import TokenLogprobs
from nanoqwen.runtime.sampling_params import SamplingParams
from nanoqwen.serve.engine_loop import EngineLoop, EngineRequest
from nanoqwen.serve.errors import APIError


class ClientDisconnected(Exception):
    pass


@dataclass
class ChoiceOutput:
    """Everything one choice made so far, or since the last batch when streaming."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None

    def extend(self, text: str, token_ids: list[int], logprobs, finish_reason: str | None) -> None:
        self.text += text
        self.token_ids += token_ids
        if logprobs is not None:
            self.logprobs = (self.logprobs or []) + logprobs
        self.finish_reason = finish_reason or self.finish_reason

    def add(self, chunk: StreamChunk) -> None:
        reason = chunk.finish_reason if chunk.finished else None
        self.extend(chunk.text, chunk.token_ids, chunk.logprobs, reason)

    def merge(self, part: ChoiceOutput) -> None:
        self.extend(part.text, part.token_ids, part.logprobs, part.finish_reason)


class Generation:
    """The n choices of each prompt of one request. Choice j of prompt i has index i * n + j,
    as in OpenAI's API. Iterate batches() for the output as it comes (several engine steps'
    worth at once when the handler fell behind), or await collect() for all of it; abort()
    ends whatever is unfinished."""

    def __init__(
        self, engine: EngineLoop, prompts: list[list[int]], params: list[list[SamplingParams]]
    ) -> None:
        self.engine = engine
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.prompt_lens = [len(p) for p in prompts]
        self.requests = [
            EngineRequest(ids, sp, i * len(choices) + j, self.queue, loop)
            for i, (ids, choices) in enumerate(zip(prompts, params))
            for j, sp in enumerate(choices)
        ]
        self.unfinished = {r.index for r in self.requests}

    @property
    def num_choices(self) -> int:
        return len(self.requests)

    def start(self) -> None:
        self.engine.submit(self.requests)

    def abort(self) -> None:
        if self.unfinished:
            self.engine.abort([r for r in self.requests if r.index in self.unfinished])
            self.unfinished.clear()

    async def batches(self) -> AsyncIterator[dict[int, ChoiceOutput]]:
        """What each choice made since the last batch, in choice order."""
        try:
            while self.unfinished:
                items = [await self.queue.get()]
                while not self.queue.empty():
                    items.append(self.queue.get_nowait())
                batch: dict[int, ChoiceOutput] = {}
                for index, payload in items:
                    if isinstance(payload, Exception):
                        raise APIError(500, f"the engine failed: {payload}") from payload
                    batch.setdefault(index, ChoiceOutput()).add(payload)
                    if payload.finished:
                        self.unfinished.discard(index)
                yield dict(sorted(batch.items()))
        finally:
            self.abort()

    async def collect(self, request: Request | None = None) -> list[ChoiceOutput]:
        """All the output; with request, a client that disconnects first aborts it all."""
        outputs = [ChoiceOutput() for _ in self.requests]

        async def gather() -> None:
            async for batch in self.batches():
                for index, part in batch.items():
                    outputs[index].merge(part)

        if request is None:
            await gather()
            return outputs
        work = asyncio.ensure_future(gather())
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                self.abort()
        if not work.done() or work.cancelled():
            raise ClientDisconnected()
        work.result()  # an engine failure raises here
        return outputs


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body is read already, so the next ASGI message
    is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
