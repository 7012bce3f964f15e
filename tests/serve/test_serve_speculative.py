"""`nanoqwen serve --speculative-config`: answers equal to a plain server's, streamed and not,
and the acceptance counters in /metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import TINY_ENGINE
from .serve_harness import Server

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}  # fmt: skip
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7] * 3, [40, 41, 42, 43] * 5]


@pytest.fixture(scope="module")
def spec_server(tiny_model, tmp_path_factory):
    server = Server(
        ["--model", str(tiny_model[0]), *TINY_ENGINE, "--speculative-config", json.dumps(SPEC)],
        tmp_path_factory.mktemp("serve") / "spec.log",
    )
    yield server
    server.close()


def complete(server: Server, prompt: list[int], stream: bool = False) -> list[int] | str:
    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "logprobs": 1, "stream": stream}  # fmt: skip
    if not stream:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        r.raise_for_status()
        return r.json()["choices"][0]["logprobs"]["tokens"]
    text = ""
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_answers_equal_a_plain_servers_and_metrics_count_acceptance(tiny_server, spec_server):
    for prompt in PROMPTS:
        assert complete(spec_server, prompt) == complete(tiny_server, prompt)
        assert complete(spec_server, prompt, stream=True) == complete(tiny_server, prompt, True)
    m = spec_server.wait_idle()
    drafts = m["nanoqwen:spec_decode_num_drafts_total"]
    proposed = m["nanoqwen:spec_decode_num_draft_tokens_total"]
    accepted = m["nanoqwen:spec_decode_num_accepted_tokens_total"]
    assert 0 < drafts <= proposed and 0 < accepted <= proposed
    assert tiny_server.metrics()["nanoqwen:spec_decode_num_draft_tokens_total"] == 0
