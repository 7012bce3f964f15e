"""One API request's choices as they run in the engine loop, seen from its HTTP handler."""

from __future__ import annotations

import asyncio
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
    """What one choice made: all of it, or since the last batch when streaming."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None

    @classmethod
    def of(cls, chunk: StreamChunk) -> ChoiceOutput:
        reason = chunk.finish_reason if chunk.finished else None
        return cls(chunk.text, chunk.token_ids, chunk.logprobs, reason)

    def merge(self, part: ChoiceOutput) -> None:
        self.text += part.text
        self.token_ids = self.token_ids + part.token_ids
        if part.logprobs is not None:
            self.logprobs = (self.logprobs or []) + part.logprobs
        self.finish_reason = part.finish_reason or self.finish_reason


class Generation:
    """The n choices of each prompt of one request. Choice j of prompt i has index i * n + j,
    as in OpenAI's API. Await next_batch() for the output as it comes (several engine
    deliveries' worth at once when the handler fell behind), or collect() for all of it;
    abort() ends whatever is unfinished.

    The engine loop's thread hands output in through push(), run on the event loop."""

    def __init__(
        self, engine: EngineLoop, prompts: list[list[int]], params: list[list[SamplingParams]]
    ) -> None:
        self.engine = engine
        self._loop = asyncio.get_running_loop()
        self._items: list[tuple[int, StreamChunk | Exception]] = []
        self._waiter: asyncio.Future | None = None
        self.prompt_lens = [len(p) for p in prompts]
        self.requests = [
            EngineRequest(ids, sp, i * len(choices) + j, self, self._loop)
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

    def push(self, index: int, payload: StreamChunk | Exception) -> None:
        self._items.append((index, payload))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next_batch(self) -> dict[int, ChoiceOutput]:
        """What each choice made since the last batch, in choice order; call it while
        `unfinished` is not empty. An engine failure raises APIError(500)."""
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        batch: dict[int, ChoiceOutput] = {}
        for index, payload in items:
            if isinstance(payload, Exception):
                self.abort()
                raise APIError(500, f"the engine failed: {payload}") from payload
            part = ChoiceOutput.of(payload)
            if index in batch:
                batch[index].merge(part)
            else:
                batch[index] = part
            if payload.finished:
                self.unfinished.discard(index)
        return batch if len(batch) == 1 else dict(sorted(batch.items()))

    async def collect(self, request: Request | None = None) -> list[ChoiceOutput]:
        """All the output; with request, a client that disconnects first aborts it all."""
        outputs = [ChoiceOutput() for _ in self.requests]

        async def gather() -> None:
            try:
                while self.unfinished:
                    for index, part in (await self.next_batch()).items():
                        outputs[index].merge(part)
            finally:
                self.abort()

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
