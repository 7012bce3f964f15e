"""A soak of the server on the tiny model: many requests with mixed sampling settings and
lengths, streamed and whole, clients that disconnect at random points, and bursts past
--max-waiting. Afterwards nothing runs or waits, every KV block is free, the server's and the
engine's resident memory is flat after the warm-up, and their open descriptors are back to
where they were.

Small in CI (NANOQWEN_SOAK_REQUESTS, default 400: ~15 s); `NANOQWEN_SOAK_REQUESTS=5000`
runs a long one. All traffic goes to 127.0.0.1; every loop is bounded."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path

import httpx
import pytest

from .conftest import TINY_ENGINE
from .serve_harness import Server

REQUESTS = int(os.environ.get("NANOQWEN_SOAK_REQUESTS", "400"))
CONCURRENCY = 12
MAX_WAITING = 12
BURST = 40  # at once, past --max-waiting: some are refused with a 503
RSS_SLACK = 24 << 20  # allocator noise; a leak of a request's state a request would pass it
TIMEOUT_S = 60
# The host KV pool keeps evicted cached blocks up to its size, its pages touched as they are
# first used: the engine's memory grows with it until it is full. About the device pool's
# 256 blocks (8 KiB each for the tiny model), so the warm-up fills it and what the soak then
# measures is everything else.
HOST_POOL_GIB = 0.002


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def random_request(rng: random.Random) -> tuple[str, dict]:
    """An endpoint and a body: sampling settings, lengths and options mixed."""
    body: dict = {"max_tokens": rng.randint(1, 40), "stream": rng.random() < 0.5}
    temperature = rng.choice([0, 0.7, 1.0, 1.5])
    body["temperature"] = temperature
    if temperature and rng.random() < 0.5:
        body |= {"top_p": rng.choice([0.5, 0.9]), "top_k": rng.choice([0, 5, 50])}
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 1000)
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(["\n", "e", "the"])]
    if rng.random() < 0.2:
        body |= {"presence_penalty": 0.5, "repetition_penalty": 1.2, "min_p": 0.05}
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    words = " ".join(rng.choice(["def", "fib", "hello", "world", "你好", "x"]) for _ in range(8))
    if rng.random() < 0.5:
        body |= {"prompt": words * rng.randint(1, 6), "n": rng.choice([1, 1, 2])}
        if rng.random() < 0.2:
            body["logprobs"] = 2
        return "/v1/completions", body
    body["messages"] = [{"role": "user", "content": words}]
    if rng.random() < 0.2:
        body |= {"logprobs": True, "top_logprobs": 2}
    return "/v1/chat/completions", body


async def one(client: httpx.AsyncClient, rng: random.Random, counts: dict[str, int]) -> None:
    """One request; a quarter of them disconnect at a random point."""
    path, body = random_request(rng)
    disconnect = rng.random() < 0.25
    if not body["stream"]:
        try:
            r = await asyncio.wait_for(
                client.post(path, json=body), rng.uniform(0.0, 0.3) if disconnect else TIMEOUT_S
            )
        except asyncio.TimeoutError:
            counts["disconnected"] += 1
            return
        counts[str(r.status_code)] += 1
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] >= 1
        return
    async with client.stream("POST", path, json=body) as r:
        counts[str(r.status_code)] += 1
        if r.status_code != 200:
            await r.aread()
            return
        events = 0
        stop_after = rng.randint(0, 5) if disconnect else -1
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if events == stop_after:
                counts["disconnected"] += 1
                return  # leaving the block closes the connection mid-stream
            events += 1
            if line == "data: [DONE]":
                return
            assert "error" not in json.loads(line[6:]), line
        raise AssertionError("a stream ended without [DONE]")


async def soak(url: str, n: int, seed: int) -> dict[str, int]:
    """n requests from CONCURRENCY clients, with a burst of BURST every 50 requests."""
    rng = random.Random(seed)
    counts = dict.fromkeys(["200", "503", "disconnected"], 0)
    limits = httpx.Limits(max_connections=CONCURRENCY + BURST)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, limits=limits) as client:
        queue = list(range(n))

        async def worker() -> None:
            while queue:
                i = queue.pop()
                if i % 50 == 25:
                    await asyncio.gather(*(one(client, rng, counts) for _ in range(BURST)))
                await one(client, rng, counts)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    unexpected = set(counts) - {"200", "503", "disconnected"}
    assert not unexpected, counts
    return counts


@pytest.fixture
def soak_server(tiny_model, tmp_path):
    server = Server(
        ["--model", str(tiny_model[0]), *TINY_ENGINE, "--max-num-seqs", "8",
         "--max-waiting", str(MAX_WAITING), "--swap-space", str(HOST_POOL_GIB)],
        tmp_path / "soak.log",
    )  # fmt: skip
    yield server
    server.close()


def settled(read, want: int | None = None, timeout: float = 10.0) -> int:
    """read() once it equals want, or with want None once it holds still for 0.5 s: a
    server's sockets close a moment after their clients' do."""
    deadline = time.monotonic() + timeout
    last, since = read(), time.monotonic()
    while time.monotonic() < deadline:
        if last == want or (want is None and time.monotonic() - since >= 0.5):
            break
        time.sleep(0.05)
        if (got := read()) != last:
            last, since = got, time.monotonic()
    return last


def test_soak_leaves_nothing_behind(soak_server):
    server, engine = soak_server, soak_server.engine_pid()
    http = server.proc.pid
    warmup = max(40, REQUESTS // 5)
    asyncio.run(soak(server.url, warmup, seed=1))
    server.wait_idle()
    fds = {pid: settled(lambda pid=pid: num_fds(pid)) for pid in (http, engine)}
    memory = {pid: rss(pid) for pid in (http, engine)}
    start = time.monotonic()
    counts = asyncio.run(soak(server.url, REQUESTS, seed=2))
    seconds = time.monotonic() - start
    metrics = server.wait_idle()  # nothing runs or waits, every KV block is free
    grew = {pid: (rss(pid) - memory[pid]) >> 20 for pid in (http, engine)}
    print(f"soak: {REQUESTS} requests (+ bursts) in {seconds:.1f} s: {counts}; "
          f"RSS growth MiB: HTTP {grew[http]}, engine {grew[engine]}")  # fmt: skip
    assert counts["200"] >= REQUESTS // 2 and counts["503"] >= 1, counts
    assert metrics["nanoqwen:num_requests_running"] == 0
    for pid in (http, engine):
        assert settled(lambda pid=pid: num_fds(pid), fds[pid]) == fds[pid]
        assert rss(pid) - memory[pid] < RSS_SLACK, (pid, memory[pid], rss(pid))
    assert "Traceback" not in server.log()
