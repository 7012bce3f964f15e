"""An engine step that raises (a bug, device out of memory) fails the requests it ran with a
500, whole or mid-stream, and the server goes on serving; an engine process that is gone
fails them too, turns /health to 503 and stops the server. The app in-process over httpx, its
engine loop (EngineCore.serve, the engine process's loop) in a thread over real pipes."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from multiprocessing import Pipe

import httpx
import pytest

from nanoqwen import LLM
from nanoqwen.serve.app import ServerConfig, build_app
from nanoqwen.serve.engine_client import EngineClient
from nanoqwen.serve.engine_core import EngineCore
from nanoqwen.serve.model_info import ModelInfo

BODY = {"prompt": "Hello", "max_tokens": 30, "ignore_eos": True, "temperature": 0}


@pytest.fixture
def app_and_llm(tiny_model):
    llm = LLM(str(tiny_model[0]), block_size=16, num_kv_blocks=64, progress=False)
    in_recv, in_send = Pipe(duplex=False)
    out_recv, out_send = Pipe(duplex=False)
    loop = threading.Thread(target=EngineCore(llm).serve, args=(in_recv, out_send), daemon=True)
    loop.start()
    engine = EngineClient(in_send, out_recv)
    info = ModelInfo(llm.tokenizer, llm.max_model_len, llm.config.vocab_size)
    yield build_app(engine, info, ServerConfig("tiny")), llm
    engine.shutdown()
    loop.join(10)
    assert not loop.is_alive()


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
        app.state.engine.start(asyncio.get_running_loop())  # httpx's transport runs no lifespan
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


def test_engine_gone_fails_requests_turns_health_503_and_stops_the_server(tiny_model):
    """The engine process's end of the pipe closes (it died): the requests in flight end with
    an error at once, /health answers 503, new requests a 500, and on_exit (the server's
    stop) is called."""
    llm = LLM(str(tiny_model[0]), block_size=16, num_kv_blocks=64, progress=False)
    in_recv, in_send = Pipe(duplex=False)
    out_recv, out_send = Pipe(duplex=False)
    engine = EngineClient(in_send, out_recv)  # no engine loop: the requests just wait
    stopped: list[float] = []
    engine.on_exit = lambda: stopped.append(time.monotonic())
    info = ModelInfo(llm.tokenizer, llm.max_model_len, llm.config.vocab_size)
    app = build_app(engine, info, ServerConfig("tiny"))

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        engine.start(asyncio.get_running_loop())
        async with httpx.AsyncClient(transport=transport, base_url="http://nanoqwen") as c:
            assert (await c.get("/health")).status_code == 200
            whole = asyncio.create_task(c.post("/v1/completions", json=BODY))
            streamed = asyncio.create_task(c.post("/v1/completions", json={**BODY, "stream": True}))
            while engine.num_waiting < 2:
                await asyncio.sleep(0.01)
            out_send.close()  # as the engine process's death closes it
            died = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(whole, streamed), 10)
            health = await c.get("/health")
            after = await c.post("/v1/completions", json=BODY)
            return died, *results, health, after

    died, whole, streamed, health, after = asyncio.run(scenario())
    why = "the engine process exited (exit code None)"
    assert whole.status_code == 500
    assert whole.json()["error"]["message"] == f"the engine failed: {why}"
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == f"the engine failed: {why}"
    assert (health.status_code, health.json()) == (503, {"status": why})
    assert after.status_code == 500
    assert len(stopped) == 1 and stopped[0] - died < 1.0
    engine.shutdown()
    in_recv.close()
