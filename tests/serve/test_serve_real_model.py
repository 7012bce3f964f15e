"""The real Qwen2.5-Coder-0.5B-Instruct behind `nanoqwen serve` with no --model (the default
checkpoint): greedy chat and completions give LLM.generate's tokens, streamed or not."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from nanoqwen import LLM, SamplingParams
from nanoqwen.weights.hub import DEFAULT_MODEL_NAME

from .serve_harness import Server

pytestmark = pytest.mark.real_model

CHATS = [
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [
        {"role": "system", "content": "You are a terse senior Python reviewer."},
        {"role": "user", "content": "Is `l == None` fine?"},
    ],
]
CODE = "def quicksort(arr):\n"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(real_model_dir, tmp_path_factory):
    # float32: the token-exact mode. bf16 (dtype auto on a CPU with bf16) rounds differently
    # with the engine process's thread count and the batch's shape.
    server = Server(
        ["--device", "cpu", "--dtype", "float32"], tmp_path_factory.mktemp("serve") / "real.log"
    )
    yield server
    server.close()


@pytest.fixture(scope="module")
def llm(real_model_dir) -> LLM:
    return LLM(device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_default_checkpoint_is_served(client):
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL_NAME]


def test_greedy_chat_and_completion_match_generate(client, llm, server):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    prompts = [llm.tokenizer.encode_chat(m) for m in CHATS] + [llm.encode(CODE)]
    want = llm.generate(prompts, greedy)
    extra = {"return_token_ids": True}

    def chat(messages):
        return client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_body=extra,
        ).choices[0]  # fmt: skip

    def complete(prompt):
        return client.completions.create(
            model=DEFAULT_MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body=extra,
        ).choices[0]  # fmt: skip

    with ThreadPoolExecutor(3) as pool:  # together, as one running batch
        got = [*pool.map(chat, CHATS), pool.submit(complete, CODE).result()]
    for g, w in zip(got, want):
        assert g.model_extra["token_ids"] == w.token_ids
        assert (g.message.content if hasattr(g, "message") else g.text) == w.text
        assert g.finish_reason == w.finish_reason
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=CHATS[0], max_tokens=MAX_TOKENS, temperature=0,
        stream=True,
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want[0].text
    server.wait_idle()
