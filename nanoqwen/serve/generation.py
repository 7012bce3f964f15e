"""One API request's choices as they run in the engine process, seen from its HTTP handler."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from nanoqwen.runtime.sampling_params import SamplingParams
from nanoqwen.serve.echo import Echo
from nanoqwen.serve.engine_client import ChoiceOutput, EngineClient, EngineDeadError, EngineRequest
from nanoqwen.serve.errors import APIError


class ClientDisconnected(Exception):
    pass


class Generation:
    """The n choices of each prompt of one request. Choice j of prompt i has index i * n + j,
    as in OpenAI's API. Await next_batch() for the output as it comes (several engine
    deliveries' worth at once when the handler fell behind), or collect() for all of it;
    abort() ends whatever is unfinished.

    The EngineClient hands output in through push(), on the event loop."""

    def __init__(
        self, engine: EngineClient, prompts: list[list[int]], params: list[list[SamplingParams]]
    ) -> None:
        self.engine = engine
        self._loop = asyncio.get_running_loop()
        self._items: list[tuple[int, ChoiceOutput | Exception]] = []
        self._waiter: asyncio.Future | None = None
        self.prompt_lens = [len(p) for p in prompts]
        self.first_choices = [i * len(choices) for i, choices in enumerate(params)]
        self.requests = [
            EngineRequest(ids, sp, i * len(choices) + j, self)
            for i, (ids, choices) in enumerate(zip(prompts, params))
            for j, sp in enumerate(choices)
        ]
        self.unfinished = {r.index for r in self.requests}
        self.echo: Echo | None = None  # /v1/completions' echo: the prompt in front

    @property
    def num_choices(self) -> int:
        return len(self.requests)

    def start(self) -> None:
        try:
            self.engine.submit(self.requests)
        except EngineDeadError as e:
            self.unfinished.clear()
            raise APIError(500, f"the engine failed: {e}") from e

    def abort(self) -> None:
        if self.unfinished:
            self.engine.abort([r for r in self.requests if r.index in self.unfinished])
            self.unfinished.clear()

    def push(self, index: int, payload: ChoiceOutput | Exception) -> None:
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
            if self.echo is not None:
                self.echo.apply(index, payload)
            if index in batch:
                batch[index].merge(payload)
            else:
                batch[index] = payload
            if payload.finish_reason is not None:
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
