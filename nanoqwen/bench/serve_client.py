"""The serving benchmark's load generator: streaming completion requests sent on a schedule,
from several client processes.

One asyncio client in Python parses a few tens of thousands of streamed events a second; a
burst of 256 requests to the 0.5B model on an H200 streams ~85,000 events in ~3 s, so one
client process would measure itself rather than the server. Each process takes every n-th
request and keeps its arrival time; all start together (after a barrier, past their imports)
and their timestamps share one monotonic clock."""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    finished: float = 0.0  # time.perf_counter() when the request ended, one clock for all


def default_client_processes() -> int:
    """A quarter of the cores, 1 to 4: the server and the engine need the rest."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


async def one_request(client, url: str, body: dict, api_key: str | None) -> RequestResult:
    result = RequestResult()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = event["error"]["message"]
                    return result
                choices = event["choices"]
                tokens = len(choices[0].get("token_ids") or []) if choices else 0
                if tokens:
                    now = time.perf_counter()
                    if result.output_tokens == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.output_tokens += tokens
    except Exception as e:  # a dropped connection counts as a failed request
        result.error = f"{type(e).__name__}: {e}"
        return result
    finally:
        result.finished = time.perf_counter()
    result.e2e = result.finished - start
    result.ok = result.output_tokens == body["max_tokens"]
    if not result.ok:
        result.error = f"{result.output_tokens} tokens, {body['max_tokens']} asked for"
    return result


async def _send_all(
    url: str, api_key: str | None, bodies: list[dict], times: list[float], start: float,
    concurrency: int,
) -> list[RequestResult]:  # fmt: skip
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def send(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, start + times[i] - time.perf_counter()))
            async with gate:
                return await one_request(client, url, bodies[i], api_key)

        return await asyncio.gather(*(send(i) for i in range(len(bodies))))


def _client_main(barrier, results, index: int, url, api_key, bodies, times, concurrency) -> None:
    import httpx  # noqa: F401  (imported before the barrier: start-up is not measured)

    barrier.wait()
    start = time.perf_counter()
    results.put((index, asyncio.run(_send_all(url, api_key, bodies, times, start, concurrency))))


def send_requests(
    url: str,
    api_key: str | None,
    bodies: list[dict],
    times: list[float],
    processes: int,
    max_concurrency: int | None = None,
) -> tuple[list[RequestResult], float]:
    """Sends bodies[i] at times[i] seconds from the common start; returns the results in the
    bodies' order and the seconds from the start to the last request's end."""
    ctx = mp.get_context("spawn")
    n = max(1, min(processes, len(bodies)))
    concurrency = math.ceil((max_concurrency or len(bodies)) / n)
    shares = [list(range(i, len(bodies), n)) for i in range(n)]
    barrier, queue = ctx.Barrier(n + 1), ctx.Queue()
    procs = [
        ctx.Process(
            target=_client_main,
            args=(
                barrier,
                queue,
                i,
                url,
                api_key,
                [bodies[j] for j in share],
                [times[j] for j in share],
                concurrency,
            ),
            daemon=True,
        )  # fmt: skip
        for i, share in enumerate(shares)
    ]
    for p in procs:
        p.start()
    barrier.wait()
    start = time.perf_counter()
    results: list[RequestResult | None] = [None] * len(bodies)
    for _ in procs:
        index, share_results = queue.get()
        for j, r in zip(shares[index], share_results, strict=True):
            results[j] = r
    for p in procs:
        p.join()
    done = [r for r in results if r is not None]
    return done, max(r.finished for r in done) - start
