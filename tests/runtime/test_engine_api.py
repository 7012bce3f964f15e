"""The public LLM API on the tiny model: prompt forms, per-prompt params, outputs, stop
conditions, and streaming (incl. multi-byte UTF-8 and closing a stream early)."""

from __future__ import annotations

import pytest
import torch

from nanoqwen import LLM, SamplingParams, StreamChunk

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# Greedy outputs of these hold multi-byte characters whose bytes come from several tokens.
MULTIBYTE_PROMPTS = ["很好", "天气"]
PROMPTS = ["The quick brown fox", "def fib(n):", *MULTIBYTE_PROMPTS, "你好，世界。", "Hello world"]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model[0]), num_kv_blocks=64, block_size=16, progress=False)


@pytest.fixture(scope="module")
def greedy_outputs(llm):
    """prompt -> (token ids, text) of a 16-token greedy run, generated one prompt at a time."""
    return {p: (o.token_ids, o.text) for p in PROMPTS for o in llm.generate(p, GREEDY)}


def assert_idle(llm: LLM) -> None:
    """No request left behind: every KV block free, nothing queued or running."""
    sched = llm.scheduler
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks
    assert not sched.waiting and not sched.running
    assert not llm.output_processor.detokenizers


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def decode(llm: LLM, ids: list[int]) -> str:
    return llm.tokenizer.decode(ids, skip_special_tokens=True)


def first_stop_at(llm: LLM, ids: list[int], stop: str) -> int:
    """How many tokens a request with stop string `stop` generates: up to the first token
    whose decoded text contains it, counting only text the detokenizer releases (it holds
    back a decode that ends in an incomplete UTF-8 sequence)."""
    for n in range(1, len(ids) + 1):
        text = decode(llm, ids[:n])
        if not text.endswith("\ufffd") and stop in text:
            return n
    raise AssertionError(f"{stop!r} not in the output")


def clean_substring(text: str, start: int, length: int = 3) -> tuple[int, str]:
    """The first substring of text at or after start (else anywhere) that has no U+FFFD and
    does not occur earlier, and its index."""
    for i in [*range(start, len(text) - length + 1), *range(start)]:
        sub = text[i : i + length]
        if "\ufffd" not in sub and text.find(sub) == i:
            return i, sub
    raise AssertionError(f"no clean substring in {text!r}")


# ---- prompts and params ------------------------------------------------------------------------
def test_string_and_token_id_prompts_agree(llm, greedy_outputs):
    prompt = "The quick brown fox"
    ids = llm.tokenizer.encode(prompt)
    single_str = llm.generate(prompt, GREEDY)
    single_ids = llm.generate(ids, GREEDY)
    both = llm.generate([prompt, ids], GREEDY)
    assert len(single_str) == len(single_ids) == 1 and len(both) == 2
    expected = greedy_outputs[prompt][0]
    for out in [single_str[0], single_ids[0], *both]:
        assert out.prompt_token_ids == ids
        assert out.token_ids == expected
    assert_idle(llm)


def test_token_ids_are_the_generated_tokens_only(llm, tiny_model):
    hf_model = tiny_model[1]
    for prompt in ["def fib(n):", "你好"]:
        ids = llm.tokenizer.encode(prompt)
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        assert out[0].prompt_token_ids == ids
        assert out[0].token_ids == hf_greedy(hf_model, ids, 6)


def test_one_params_per_prompt(llm, greedy_outputs):
    prompts = PROMPTS[:3]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 7, 1)]
    outs = llm.generate(prompts, params)
    for prompt, sp, out in zip(prompts, params, outs):
        assert out.token_ids == greedy_outputs[prompt][0][: sp.max_tokens]
        assert out.finish_reason == "length"
    assert_idle(llm)


@pytest.mark.parametrize("n_params", [0, 2, 4])
def test_params_count_mismatch_is_refused(llm, n_params):
    params = [GREEDY] * n_params
    with pytest.raises(ValueError, match=rf"sampling_params has {n_params} entries for 3"):
        llm.generate(PROMPTS[:3], params)
    with pytest.raises(ValueError, match=rf"sampling_params has {n_params} entries for 3"):
        list(llm.stream(PROMPTS[:3], params))
    assert_idle(llm)


def test_a_bad_prompt_leaves_no_request_behind(llm, greedy_outputs):
    vocab = llm.config.vocab_size
    with pytest.raises(
        ValueError, match=rf"holds the token id {vocab}: allowed .* 0\.\.{vocab - 1}$"
    ):
        llm.generate(["Hello world", [1, vocab]], GREEDY)
    assert_idle(llm)
    out = llm.generate("Hello world", GREEDY)[0]
    assert out.token_ids == greedy_outputs["Hello world"][0]


# ---- outputs -----------------------------------------------------------------------------------
def test_text_is_the_decoded_output_and_length_finishes(llm, greedy_outputs):
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_outputs[prompt][0]
        assert len(out.token_ids) == GREEDY.max_tokens
        assert out.text == decode(llm, out.token_ids)
        assert out.finish_reason == "length"
        assert out.stop_reason is None  # as vLLM: None when max_tokens ends a request
        assert out.metrics["latency_s"] >= out.metrics["ttft_s"] > 0


def test_stop_token_ids_end_the_request(llm, greedy_outputs):
    ids = greedy_outputs["def fib(n):"][0]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    params = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[ids[k]])
    out = llm.generate("def fib(n):", params)[0]
    assert out.token_ids == ids[: k + 1]  # the stop token is kept in token_ids
    assert out.finish_reason == "stop"
    assert out.stop_reason == ids[k]  # which stop token, as vLLM reports it
    assert out.text == decode(llm, ids[: k + 1])
    # min_tokens past it: the token is banned and the request runs on.
    params = SamplingParams(
        temperature=0.0, max_tokens=16, min_tokens=k + 1, stop_token_ids=[ids[k]]
    )
    out = llm.generate("def fib(n):", params)[0]
    assert out.token_ids[:k] == ids[:k]
    assert ids[k] not in out.token_ids[: k + 1]
    assert len(out.token_ids) >= k + 1
    assert_idle(llm)


def test_eos_ends_the_request_unless_ignored(llm, greedy_outputs, monkeypatch):
    ids = greedy_outputs["The quick brown fox"][0]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    eos = frozenset({ids[k]})  # pretend the model's k-th greedy token is its EOS
    monkeypatch.setattr(llm, "eos_token_ids", eos)
    monkeypatch.setattr(llm.runner.sampler, "eos_token_ids", eos)
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert out.token_ids == ids[: k + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason is None  # EOS, as vLLM reports it
    out = llm.generate("The quick brown fox", GREEDY)[0]  # ignore_eos
    assert out.token_ids == ids and out.finish_reason == "length"
    assert_idle(llm)


def test_stop_string_trims_the_text_and_ends_generation(llm, greedy_outputs):
    for prompt in PROMPTS:
        ids, full = greedy_outputs[prompt]
        k, stop = clean_substring(full, start=2)
        n = first_stop_at(llm, ids, stop)
        params = SamplingParams(temperature=0.0, max_tokens=16, stop=["\x00never", stop])
        out = llm.generate(prompt, params)[0]
        assert out.text == full[:k], prompt
        assert out.token_ids == ids[:n], prompt
        assert out.finish_reason == "stop" or n == len(ids)
        if out.finish_reason == "stop":
            assert out.stop_reason == stop, prompt  # which stop string


def test_the_context_length_ends_a_request_by_length(tiny_model, greedy_outputs):
    """max_model_len cuts an answer before max_tokens: finish_reason "length", stop_reason
    None (as vLLM), and fewer tokens than max_tokens, which tells the two apart."""
    llm = LLM(str(tiny_model[0]), num_kv_blocks=8, block_size=16, max_model_len=12, progress=False)
    prompt = llm.encode("The quick brown fox")
    out = llm.generate([prompt], GREEDY)[0]
    assert len(prompt) + len(out.token_ids) == 12 < len(prompt) + GREEDY.max_tokens
    assert out.token_ids == greedy_outputs["The quick brown fox"][0][: 12 - len(prompt)]
    assert (out.finish_reason, out.stop_reason) == ("length", None)


def test_stream_reports_the_stop_reason_on_the_last_chunk(llm, greedy_outputs):
    ids = greedy_outputs["def fib(n):"][0]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    params = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[ids[k]])
    chunks = list(llm.stream("def fib(n):", params))
    assert [c.stop_reason for c in chunks] == [None] * (len(chunks) - 1) + [ids[k]]
    assert chunks[-1].finished and chunks[-1].finish_reason == "stop"


def test_stop_string_is_ignored_until_min_tokens(llm, greedy_outputs):
    """vLLM semantics: a stop string must end in text of a token past min_tokens."""
    prompt = "The quick brown fox"
    ids, full = greedy_outputs[prompt]
    k, stop = clean_substring(full, start=0, length=2)
    n = first_stop_at(llm, ids, stop)
    assert full.count(stop) == 1 and n < 10
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=n, stop=stop)
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == ids[:10] and out.finish_reason == "length"
    assert out.text == decode(llm, ids[:10])
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=n - 1, stop=stop)
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == ids[:n] and out.text == full[:k]


# ---- streaming ---------------------------------------------------------------------------------
def collect(chunks) -> dict[int, list[StreamChunk]]:
    per: dict[int, list[StreamChunk]] = {}
    for chunk in chunks:
        assert isinstance(chunk, StreamChunk)
        per.setdefault(chunk.index, []).append(chunk)
    return per


def held_back_positions(llm: LLM, ids: list[int]) -> int:
    """How often the next token rewrites the end of the decoded prefix (bytes of one
    character spread over tokens), which a naive streamer would emit as U+FFFD."""
    count = 0
    for n in range(1, len(ids)):
        a, b = decode(llm, ids[:n]), decode(llm, ids[: n + 1])
        if not b.startswith(a):
            count += 1
    return count


@pytest.mark.parametrize("with_stop", [False, True])
def test_stream_joins_to_the_generated_text(llm, greedy_outputs, with_stop):
    params = []
    for prompt in PROMPTS:
        _, full = greedy_outputs[prompt]
        stop = [clean_substring(full, start=len(full) // 2)[1]] if with_stop else None
        params.append(SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=stop))
    expected = llm.generate(PROMPTS, params)
    per = collect(llm.stream(PROMPTS, params))
    assert sorted(per) == list(range(len(PROMPTS)))
    for i, out in enumerate(expected):
        chunks = per[i]
        assert "".join(c.text for c in chunks) == out.text
        assert [t for c in chunks for t in c.token_ids] == out.token_ids
        assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert chunks[-1].finish_reason == out.finish_reason
        assert all(c.finish_reason is None for c in chunks[:-1])
        assert all("\ufffd" not in c.text for c in chunks if "\ufffd" not in out.text)
        if with_stop:
            assert out.finish_reason == "stop"
            assert out.text == greedy_outputs[PROMPTS[i]][1][: len(out.text)]
    # The multi-byte prompts really exercise held-back bytes.
    for prompt in MULTIBYTE_PROMPTS:
        assert held_back_positions(llm, greedy_outputs[prompt][0]) > 0, prompt
    assert_idle(llm)


def test_closing_a_stream_early_aborts_and_frees(llm, greedy_outputs):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    stream = llm.stream(PROMPTS[:3], params)
    seen = [next(stream) for _ in range(5)]
    assert not any(c.finished for c in seen)
    assert llm.scheduler.blocks.num_free_blocks < llm.scheduler.blocks.num_blocks
    stream.close()
    assert_idle(llm)
    out = llm.generate(PROMPTS[0], GREEDY)[0]
    assert out.token_ids == greedy_outputs[PROMPTS[0]][0]
    assert_idle(llm)


def test_a_stream_abandoned_by_break_is_cleaned_up(llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def consume():
        for chunk in llm.stream(PROMPTS[:2], params):
            if chunk.index == 1:
                break

    consume()  # the generator is closed when it is dropped
    assert_idle(llm)
