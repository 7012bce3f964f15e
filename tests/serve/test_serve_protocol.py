"""The server's pieces without a server: the hand-written chunk encoder against the pydantic
models, logprobs in OpenAI's two shapes, and the benchmark's workload and arrivals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nanoqwen.bench.serve import arrival_times, make_workload
from nanoqwen.bench.workloads import throughput_workload
from nanoqwen.runtime.logprobs import TokenLogprobs
from nanoqwen.serve.protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    Delta,
)
from nanoqwen.serve.responses import ChunkEncoder, chat_logprobs, completion_logprobs

TEXTS = [
    "",
    "plain",
    'quote " and \\ backslash',
    "\n\t\r\b\f\x00\x1f\x7f",
    "你好 🙂 é",
    "\u2028\u2029",
]
BASE = dict(id="cmpl-1", created=1700000000, model='m "1"/é')


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish_reason", [None, "stop", "length"])
@pytest.mark.parametrize("token_ids", [None, [], [1, 23, 456]])
@pytest.mark.parametrize("include_usage", [False, True])
def test_chunk_encoder_writes_what_the_models_write(text, finish_reason, token_ids, include_usage):
    exclude = None if include_usage else {"usage"}
    encode = ChunkEncoder(CompletionChunk(**BASE, choices=[]), include_usage)
    choice = CompletionChoice(index=3, text=text, finish_reason=finish_reason, token_ids=token_ids)
    model = CompletionChunk(**BASE, choices=[choice]).model_dump_json(exclude=exclude)
    assert encode.completion(3, text, finish_reason, token_ids) == f"data: {model}\n\n"

    encode = ChunkEncoder(ChatCompletionChunk(**BASE, choices=[]), include_usage)
    choice = ChatStreamChoice(
        index=3, delta=Delta(content=text), finish_reason=finish_reason, token_ids=token_ids
    )
    model = ChatCompletionChunk(**BASE, choices=[choice]).model_dump_json(exclude=exclude)
    assert encode.chat(3, text, finish_reason, token_ids) == f"data: {model}\n\n"
    assert json.loads(model)["choices"][0]["delta"] == {"content": text}


ENTRIES = [
    TokenLogprobs(token_id=7, logprob=-0.25, rank=1, top=[(7, -0.25), (9, -1.5)]),
    TokenLogprobs(token_id=12, logprob=-2.0, rank=3, top=[(4, -0.5), (5, -1.0)]),
]
TEXT_OF = {7: "ab", 9: "x", 12: "é", 4: "cd", 5: " "}


def test_completion_logprobs_shape():
    out = completion_logprobs(ENTRIES, TEXT_OF.__getitem__, offset=10)
    assert out.model_dump() == {
        "tokens": ["ab", "é"],
        "token_logprobs": [-0.25, -2.0],
        "top_logprobs": [{"ab": -0.25, "x": -1.5}, {"cd": -0.5, " ": -1.0}],
        "text_offset": [10, 12],
    }
    assert completion_logprobs(None, TEXT_OF.__getitem__, 0) is None


def test_chat_logprobs_shape():
    out = chat_logprobs(ENTRIES, TEXT_OF.__getitem__)
    first, second = out.model_dump()["content"]
    assert first == {
        "token": "ab",
        "logprob": -0.25,
        "bytes": [97, 98],
        "top_logprobs": [
            {"token": "ab", "logprob": -0.25, "bytes": [97, 98]},
            {"token": "x", "logprob": -1.5, "bytes": [120]},
        ],
    }
    assert second["token"] == "é" and second["bytes"] == [0xC3, 0xA9]
    assert [t["token"] for t in second["top_logprobs"]] == ["cd", " "]


def test_default_workload_is_the_offline_benchmarks():
    prompts, out_lens = throughput_workload(16, seed=3)
    work = make_workload(16, seed=3)
    assert work.prompts == prompts and work.output_lens == out_lens
    small = make_workload(50, (5, 9), (2, 4), max_token_id=30, seed=1)
    assert all(5 <= len(p) <= 9 and max(p) <= 30 for p in small.prompts)
    assert set(small.output_lens) <= {2, 3, 4}


def test_arrivals():
    assert arrival_times(5, float("inf"), 0) == [0.0] * 5
    times = arrival_times(4000, 20.0, seed=0)
    gaps = np.diff([0.0, *times])
    assert (gaps > 0).all() and times == sorted(times)
    assert abs(gaps.mean() - 1 / 20) < 0.005  # Poisson: exponential gaps of mean 1/rate
    assert abs(gaps.std() - 1 / 20) < 0.005
    assert arrival_times(10, 20.0, seed=0) == times[:10]
