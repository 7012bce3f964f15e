"""An engine step that raises (a bug, device out of memory) fails the requests it ran with a
500, whole or mid-stream, and the server goes on serving: the app in-process over httpx."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from nanoqwen import LLM
from nanoqwen.serve.app import ServerConfig, build_app

BODY = {"prompt": "Hello", "max_tokens": 30, "ignore_eos": True, "temperature": 0}


@pytest.fixture
def app_and_llm(tiny_model):
    llm = LLM(str(tiny_model[0]), block_size=16, num_kv_blocks=64, progress=False)
    app = build_app(llm, ServerConfig("tiny"))
    app.state.engine.start()  # httpx's ASGI transport runs no lifespan
    yield app, llm
    app.state.engine.stop()


def test_failed_step_fails_its_requests_and_the_server_goes_on(app_and_llm):
    app, llm = app_and_llm
    step, fail_next = llm.step, []

    def flaky_step():
        if fail_next:
            fail_next.clear()
            raise RuntimeError("simulated device failure")
        return step()

    llm.step = flaky_step

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://nanoqwen") as c:
            fail_next.append(True)
            whole = await c.post("/v1/completions", json=BODY)
            fail_next.append(True)
            streamed = await c.post("/v1/completions", json={**BODY, "stream": True})
            after = await c.post("/v1/completions", json=BODY)
            return whole, streamed, after

    whole, streamed, after = asyncio.run(scenario())
    assert whole.status_code == 500
    assert "simulated device failure" in whole.json()["error"]["message"]
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "simulated device failure" in json.loads(events[-2])["error"]["message"]
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 30
    blocks = llm.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    assert app.state.engine.alive
