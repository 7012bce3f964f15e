"""The server on a GPU (random weights of the 0.5B shape, bfloat16, CUDA graphs): one request
at a time gives LLM.generate's tokens on the same weights, a burst of 64 streams all
complete with every KV block free after, and the engine process killed mid-stream fails its
requests and stops the server. Skipped without CUDA; on the GPU machine it needs
the serve wheels (tools/serve_wheels.sh install) on PYTHONPATH."""

from __future__ import annotations

import asyncio
import gc
import json
import random

import httpx
import pytest
import torch

from nanoqwen import LLM, SamplingParams

from .serve_harness import Server
from .test_serve_engine_process import engine_death_stops_the_server

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
# Two engines share the GPU: the server's and the reference. gpu_memory_utilization caps
# the whole GPU's use (other processes count), so the reference, started second, asks for
# the server's share plus its own.
ENGINE = ["--random-shape", "0.5B", "--device", "cuda", "--gpu-memory-utilization", "0.3"]
REFERENCE_UTILIZATION = 0.7


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(ENGINE, tmp_path_factory.mktemp("serve") / "gpu.log", timeout=600)
    yield server
    server.close()


def test_sequential_greedy_requests_match_generate(server):
    llm = LLM(
        random_shape="0.5B",
        device="cuda",
        gpu_memory_utilization=REFERENCE_UTILIZATION,
        progress=False,
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(rng.randint(20, 300))] for _ in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for prompt in prompts:  # batch size 1 on both sides: the same kernels, the same tokens
        want = llm.generate([prompt], greedy)[0].token_ids
        body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
        assert got["choices"][0]["token_ids"] == want
    del llm
    gc.collect()
    torch.cuda.empty_cache()  # the next tests start engines of their own


def test_burst_of_streams_completes_and_frees_the_cache(server):
    rng = random.Random(1)

    async def one(client, i):
        n = 16 + i % 17
        body = {"prompt": [rng.randrange(10000) for _ in range(64)], "max_tokens": n,
                "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
        tokens = 0
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    tokens += len(event["choices"][0]["token_ids"])
        return tokens == n

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    assert all(asyncio.run(burst()))
    server.wait_idle()


def test_engine_process_death_on_cuda_stops_the_server(tmp_path):
    # Long enough that both requests still run when the engine is killed.
    prompt = list(range(1, 33))
    # The module's server holds its 0.3 of the GPU meanwhile (the reference engine's memory
    # went back): this one's cap, which counts the other server, leaves it as much again.
    engine = [*ENGINE[:4], "--gpu-memory-utilization", "0.6"]
    engine_death_stops_the_server(engine, tmp_path / "death.log", prompt, max_tokens=30000)
