"""The parts of OpenAI's and vLLM's API that clients and evaluation harnesses expect:
/tokenize and /detokenize, the prefix cache's hits in usage.prompt_tokens_details, sampling
defaults from the checkpoint's generation_config.json (--generation-config), echo with prompt
logprobs, and logit_bias."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from openai import OpenAI

from nanoqwen.weights.tokenizer import Tokenizer

from .conftest import TINY_ENGINE
from .serve_harness import Server

MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer(tiny_model[0])


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_tokenize_a_prompt_and_messages(tiny_server, tok):
    got = post(tiny_server, "/tokenize", {"prompt": "def fib(n):"}).json()
    ids = tok.encode("def fib(n):")
    assert got == {"count": len(ids), "max_model_len": 2048, "tokens": ids}
    chat = post(tiny_server, "/tokenize", {"messages": MESSAGES, "return_token_strs": True})
    body = chat.json()
    assert body["tokens"] == tok.encode_chat(MESSAGES)
    assert "".join(body["token_strs"]) == tok.render_chat(MESSAGES)
    bare = post(tiny_server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert bare.json()["tokens"] == tok.encode_chat(MESSAGES, add_generation_prompt=False)


def test_detokenize_gives_the_text_back(tiny_server, tok):
    ids = tok.encode("The quick brown fox")
    got = post(tiny_server, "/detokenize", {"tokens": ids})
    assert got.json() == {"prompt": "The quick brown fox"}


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/tokenize", {"prompt": "a", "messages": MESSAGES},
         "give exactly one of prompt and messages"),
        ("/tokenize", {}, "give exactly one of prompt and messages"),
        ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]},
         "messages[0] is a tool result with no tool call to answer"),
        ("/detokenize", {"tokens": [1, 100000]}, "tokens=[1, 100000] holds 100000: allowed a "
         "list of token ids in 0..511"),
        ("/detokenize", {"tokens": "abc"}, "tokens: Input should be a valid array"),
    ],
)  # fmt: skip
def test_bad_token_requests_are_400s(tiny_server, path, body, message):
    got = post(tiny_server, path, body)
    assert got.status_code == 400, got.text
    assert got.json()["error"]["message"].startswith(message), got.json()


def test_prompt_tokens_from_the_prefix_cache_are_reported(tiny_server):
    client = OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)
    prompt = [(7 * i) % 500 + 1 for i in range(70)]  # 4 full blocks of 16, then 6 tokens
    first = client.completions.create(model=None, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=None, prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 64
    stream = client.completions.create(model=None, prompt=prompt, max_tokens=2, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage[0].prompt_tokens_details.cached_tokens == 64
    # n choices of one prompt count it once.
    many = client.completions.create(model=None, prompt=prompt, max_tokens=2, n=3)
    assert many.usage.prompt_tokens_details.cached_tokens == 64


@pytest.fixture(scope="module")
def greedy_checkpoint(tiny_model, tmp_path_factory):
    """The tiny model with a generation_config.json that makes sampling greedy."""
    path = tmp_path_factory.mktemp("greedy-tiny")
    shutil.copytree(tiny_model[0], path, dirs_exist_ok=True)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0}))
    return path


@pytest.mark.parametrize("generation_config", ["auto", "none"])
def test_sampling_defaults_come_from_generation_config(
    greedy_checkpoint, tmp_path, generation_config
):
    server = Server(["--model", str(greedy_checkpoint), *TINY_ENGINE, "--generation-config",
                     generation_config], tmp_path / "server.log")  # fmt: skip
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 24, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        runs = [post(server, "/v1/completions", body).json() for _ in range(2)]
        ids = [r["choices"][0]["token_ids"] for r in runs]
        if generation_config == "auto":  # temperature 0 from the file: the same tokens
            assert ids[0] == ids[1]
        else:  # OpenAI's temperature 1: 24 sampled tokens differ
            assert ids[0] != ids[1]
        explicit = post(server, "/v1/completions", {**body, "temperature": 1.0, "seed": 3})
        again = post(server, "/v1/completions", {**body, "temperature": 1.0, "seed": 3})
        assert explicit.json()["choices"][0]["token_ids"] == again.json()["choices"][0]["token_ids"]
    finally:
        server.close()


def test_echo_returns_the_prompt_and_its_logprobs(tiny_server, tok):
    client = OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)
    prompt = "The quick brown fox"
    ids = tok.encode(prompt)
    scored = client.completions.create(model=None, prompt=prompt, max_tokens=0, echo=True,
                                       logprobs=2, temperature=0)  # fmt: skip
    choice = scored.choices[0]
    assert choice.text == prompt
    lp = choice.logprobs
    assert "".join(lp.tokens) == prompt and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    # With new tokens: the prompt, then the answer, logprobs for both.
    more = client.completions.create(model=None, prompt=prompt, max_tokens=3, echo=True,
                                     logprobs=1, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    text = more.choices[0].text
    assert text.startswith(prompt) and len(more.choices[0].logprobs.tokens) == len(ids) + 3
    assert more.choices[0].logprobs.token_logprobs[1:][: len(ids) - 1] == lp.token_logprobs[1:]
    streamed = client.completions.create(model=None, prompt=prompt, max_tokens=3, echo=True,
                                         temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == text


def test_echo_with_chat_is_refused(tiny_server):
    got = post(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "echo": True})
    assert got.status_code == 400
    assert got.json()["error"]["message"] == "echo=True is for /v1/completions only"


def test_logit_bias_forces_a_token_through_the_openai_client(tiny_server):
    client = OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)
    extra = {"ignore_eos": True, "return_token_ids": True}
    got = client.completions.create(model=None, prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                    logit_bias={"42": 100}, extra_body=extra)  # fmt: skip
    assert got.choices[0].model_extra["token_ids"] == [42] * 4
    chat = client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=3,
                                          temperature=0, logit_bias={"42": 100},
                                          extra_body=extra)  # fmt: skip
    assert chat.choices[0].model_extra["token_ids"] == [42] * 3


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"600": 5}, "logit_bias: token id 600 is out of range: allowed 0..511"),
        ({"42": 150}, "logit_bias={'42': 150.0} maps 42 to 150.0: allowed a mapping of token "
         "ids to numbers in [-100, 100]"),
        ({"fox": 1}, "logit_bias={'fox': 1.0} has the key 'fox', not a token id"),
    ],
)  # fmt: skip
def test_bad_logit_bias_is_a_400(tiny_server, bias, message):
    got = post(tiny_server, "/v1/completions", {"prompt": [1, 2], "logit_bias": bias})
    assert got.status_code == 400
    assert got.json()["error"]["message"].startswith(message), got.json()
    assert got.json()["error"]["param"] == "logit_bias"
