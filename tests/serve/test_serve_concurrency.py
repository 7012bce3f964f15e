"""Many clients at once, clients that go away, and backpressure, on the tiny model: every
client gets its own text, and every KV block is back once the server is idle."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import httpx
import pytest
from openai import AsyncOpenAI

from nanoqwen import LLM, SamplingParams

from .serve_harness import wait_for

ABORTED = "nanoqwen:request_success_total{abort}"
BASE = ["The quick brown fox", "def fib(n):", "你好，世界。", "import torch", "Hello world"]


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(str(tiny_model[0]), block_size=16, num_kv_blocks=256, progress=False)


def long_request(model: str, max_tokens: int = 2000, stream: bool = True) -> dict:
    return {
        "model": model,
        "prompt": "def fib(n):",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def test_64_concurrent_streaming_clients_each_get_their_own_text(tiny_server, tiny_model, llm):
    model = str(tiny_model[0])
    prompts = [f"{BASE[i % len(BASE)]} {i}" for i in range(64)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=8 + i % 9) for i in range(64)]
    expected = llm.generate(prompts, params)

    async def one(client: AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.completions.create(
            model=model,
            prompt=prompts[i],
            temperature=0.8,
            seed=i,
            max_tokens=params[i].max_tokens,
            stream=True,
        )
        pieces, reason = [], None
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(pieces), reason

    async def everyone():
        async with AsyncOpenAI(
            base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(everyone())
    for i, ((text, reason), want) in enumerate(zip(results, expected)):
        assert (text, reason) == (want.text, want.finish_reason), i
    tiny_server.wait_idle()


def test_client_that_disconnects_mid_stream_is_aborted(tiny_server, tiny_model):
    before = tiny_server.metrics()
    body = long_request(str(tiny_model[0]))
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        received = [next(lines) for _ in range(6)]  # three events and their blank lines
    assert all(line.startswith("data: ") for line in received[::2])
    after = tiny_server.wait_idle(timeout=10)
    assert after.get(ABORTED, 0) == before.get(ABORTED, 0) + 1
    generated = (
        after["nanoqwen:generation_tokens_total"] - before["nanoqwen:generation_tokens_total"]
    )
    assert generated < 1000  # stopped long before its 2,000 tokens
    assert "Traceback" not in tiny_server.log()


def test_waiting_client_that_disconnects_is_aborted_and_backpressure(strict_server, api_key):
    """Two slots (--max-num-seqs 2), at most one sequence waiting (--max-waiting 1)."""
    server, url = strict_server, f"{strict_server.url}/v1/completions"
    auth = {"Authorization": f"Bearer {api_key}"}
    before = server.wait_idle()
    with httpx.Client(headers=auth, timeout=60) as client, contextlib.ExitStack() as streams:
        for running in (1, 2):  # one at a time: a request not yet running counts as waiting
            stream = streams.enter_context(client.stream("POST", url, json=long_request("tiny")))
            assert stream.status_code == 200
            wait_for(
                server, lambda m, n=running: m["nanoqwen:num_requests_running"] == n, "running"
            )
        timed_out = threading.Event()

        def impatient():  # a non-streaming request that gives up while it waits
            try:
                httpx.post(url, json=long_request("tiny", stream=False), headers=auth, timeout=1)
            except httpx.ReadTimeout:
                timed_out.set()

        waiter = threading.Thread(target=impatient)
        waiter.start()
        wait_for(server, lambda m: m["nanoqwen:num_requests_waiting"] == 1, "one waiting")
        refused = client.post(url, json=long_request("tiny", stream=False))
        assert refused.status_code == 503
        error = refused.json()["error"]
        assert error["type"] == "server_overloaded" and "1 requests wait" in error["message"]
        waiter.join()
        assert timed_out.is_set()
        m = wait_for(server, lambda m: m.get(ABORTED, 0) == before.get(ABORTED, 0) + 1, "abort")
        assert m["nanoqwen:num_requests_waiting"] == 0
        assert m["nanoqwen:num_requests_running"] == 2  # the two streams go on
    after = server.wait_idle(timeout=10)
    assert after[ABORTED] == before.get(ABORTED, 0) + 3
    # ignore_eos: a sampled token of the random model may be its end of text
    after_all = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    ok = httpx.post(url, json=after_all, headers=auth)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
