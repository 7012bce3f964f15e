"""The server as the openai client sees it, on the tiny model: completions and chat, streamed
and not, against LLM.generate in-process on the same prompts."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from nanoqwen import LLM, SamplingParams, __version__

PROMPTS = ["The quick brown fox", "def fib(n):", "你好，世界。", "import torch", "Hello world"]
CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "def fib(n):"},
    {"role": "assistant", "content": "return n"},
    {"role": "user", "content": "Hello world"},
]


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(str(tiny_model[0]), block_size=16, num_kv_blocks=256, progress=False)


@pytest.fixture(scope="module")
def client(tiny_server) -> OpenAI:
    return OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model[0])


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_models_health_version(tiny_server, client, model, llm):
    (card,) = client.models.list().data
    assert card.id == model and card.owned_by == "nanoqwen"
    assert card.model_extra["max_model_len"] == llm.max_model_len
    assert httpx.get(f"{tiny_server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{tiny_server.url}/version").json() == {"version": __version__}


def test_concurrent_greedy_completions_are_token_identical_to_generate(client, model, llm):
    params = SamplingParams(temperature=0, max_tokens=20)
    expected = [llm.generate(p, params)[0] for p in PROMPTS]

    def ask(prompt: str):
        return client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=20,
            temperature=0,
            extra_body={"return_token_ids": True},
        )

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # they share the running batch
        responses = list(pool.map(ask, PROMPTS))
    for prompt, want, got in zip(PROMPTS, expected, responses):
        (choice,) = got.choices
        assert token_ids(choice) == want.token_ids, prompt
        assert choice.text == want.text
        assert choice.finish_reason == want.finish_reason
        assert got.usage.prompt_tokens == len(llm.encode(prompt))
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.total_tokens == got.usage.prompt_tokens + len(want.token_ids)
        assert got.object == "text_completion" and got.model == model


def test_chat_applies_the_chat_template(client, model, llm):
    ids = llm.tokenizer.encode_chat(CHAT)
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16))[0]
    got = client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_completion_tokens=16,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    (choice,) = got.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == want.text
    assert token_ids(choice) == want.token_ids
    assert choice.finish_reason == want.finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), len(want.token_ids))
    assert got.object == "chat.completion"


@pytest.mark.parametrize("prompt", ["你好，世界。", "def fib(n):"])
def test_streamed_completion_joins_to_the_whole_text(client, model, prompt):
    kwargs = dict(model=model, prompt=prompt, max_tokens=24, temperature=0.8, seed=5)
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    *pieces, last = chunks
    assert "".join(c.choices[0].text for c in pieces) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in pieces][-1] == whole.choices[0].finish_reason
    assert all(c.usage is None for c in pieces)
    assert last.choices == [] and last.usage == whole.usage


def test_streamed_chat_joins_to_the_whole_text(client, model):
    kwargs = dict(model=model, messages=CHAT, max_tokens=24, temperature=0.8, seed=3)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        whole.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_sse_wire_format(tiny_server, model):
    # ignore_eos: an unseeded draw may pick EOS before the sixth token (finish "stop")
    body = {"model": model, "prompt": "Hello world", "max_tokens": 6, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all("usage" not in e for e in events)  # no include_usage: no usage field
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_prompt_forms_n_and_seeds(client, model, llm):
    """Token ids and a batch of them, two choices each: choice j of prompt i is index
    i * n + j and samples with seed + j, as generate does with that seed."""
    prompts = [llm.encode(p) for p in PROMPTS[:2]]
    got = client.completions.create(
        model=model, prompt=prompts, n=2, max_tokens=12, temperature=1.0, seed=11,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    for c in got.choices:
        prompt, j = prompts[c.index // 2], c.index % 2
        want = llm.generate([prompt], SamplingParams(max_tokens=12, seed=11 + j))[0]
        assert token_ids(c) == want.token_ids and c.text == want.text
    assert got.usage.prompt_tokens == sum(map(len, prompts))
    assert got.usage.completion_tokens == sum(len(token_ids(c)) for c in got.choices)
    strings = client.completions.create(model=model, prompt=PROMPTS[:2], max_tokens=12, seed=11)
    assert [c.text for c in strings.choices] == [got.choices[0].text, got.choices[2].text]


def test_stop_strings_ignore_eos_and_length(client, model, llm):
    prompt = "def fib(n):"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    stop = free.text[10:13]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop)
    want = llm.generate(prompt, params)[0]
    got = client.completions.create(
        model=model, prompt=prompt, max_tokens=30, temperature=0, stop=stop,
        extra_body={"ignore_eos": True},
    ).choices[0]  # fmt: skip
    assert want.finish_reason == "stop" and stop not in want.text
    assert (got.text, got.finish_reason) == (want.text, "stop")
    cut = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3


def test_sampling_fields_reach_the_engine(client, model, llm):
    fields = dict(temperature=0.7, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3, seed=21)
    extra = dict(top_k=20, min_p=0.05, repetition_penalty=1.2, min_tokens=8)
    want = llm.generate("import torch", SamplingParams(**fields, **extra, max_tokens=16))[0]
    got = client.completions.create(
        model=model, prompt="import torch", max_tokens=16, **fields, extra_body=extra
    )
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == len(want.token_ids) >= 8


def test_logprobs_are_the_engines(client, model, llm):
    prompt = "def fib(n):"
    want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=2))[0]
    if want.logprobs is None:
        pytest.skip("the engine does not fill RequestOutput.logprobs yet (the sampler rework)")
    text_of = [llm.tokenizer.decode([e.token_id], skip_special_tokens=False) for e in want.logprobs]
    expected = [e.logprob for e in want.logprobs]
    kwargs = dict(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    got = client.completions.create(**kwargs).choices[0].logprobs
    assert got.tokens == text_of
    assert got.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert all(1 <= len(top) <= 2 for top in got.top_logprobs)
    streamed = [c.choices[0].logprobs for c in client.completions.create(**kwargs, stream=True)]
    assert [t for lp in streamed if lp for t in lp.token_logprobs] == got.token_logprobs
    chat = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)


def test_metrics_count_tokens_and_latencies(tiny_server, client, model, llm):
    before = tiny_server.wait_idle()
    got = client.completions.create(
        model=model,
        prompt=PROMPTS[:3],
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = tiny_server.wait_idle()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("nanoqwen:prompt_tokens_total") == got.usage.prompt_tokens
    assert delta("nanoqwen:generation_tokens_total") == got.usage.completion_tokens == 21
    assert delta("nanoqwen:request_success_total{length}") == 3
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                      "e2e_request_latency_seconds", "request_prompt_tokens"):  # fmt: skip
        assert delta(f"nanoqwen:{histogram}_count") == 3, histogram
    assert delta("nanoqwen:request_generation_tokens_sum") == 21
    assert after["nanoqwen:kv_cache_total_blocks"] == 256
    assert "nanoqwen:num_preemptions_total" in after
    text = httpx.get(f"{tiny_server.url}/metrics").text
    assert 'nanoqwen:num_requests_running{model_name="' in text
