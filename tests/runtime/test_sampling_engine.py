"""Sampling through the engine: seeded requests independent of their batch, penalties and
min_tokens equal to the reference sampler under one-step-ahead decoding and preemption,
and logprobs equal to the log-softmax of the model's logits."""

from __future__ import annotations

import random

import pytest
import torch

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.sampling.reference import ReferenceSampler
from nanoqwen.runtime.sequence import Sequence

SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=2024, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model[0]), num_kv_blocks=256, block_size=8, progress=False)


def random_prompt(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(rng.randrange(3, 40))]


def mixed_params(rng: random.Random) -> SamplingParams:
    return rng.choice(
        [
            SamplingParams(temperature=0, max_tokens=rng.randrange(1, 20)),
            SamplingParams(temperature=0.8, top_k=20, max_tokens=rng.randrange(1, 20)),
            SamplingParams(temperature=1.0, repetition_penalty=1.2, max_tokens=9),
            SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, seed=rng.randrange(99)),
            SamplingParams(temperature=0, presence_penalty=0.5, min_tokens=3, max_tokens=12),
        ]
    )


@pytest.mark.parametrize("batch", [1, 7, 33])
def test_seeded_request_ignores_its_batch(llm, batch):
    prompt = [5, 17, 29, 3, 8, 100]
    alone = llm.generate([prompt], SEEDED)[0].token_ids
    assert len(alone) == 16
    rng = random.Random(batch)
    vocab = llm.config.vocab_size
    prompts = [random_prompt(rng, vocab) for _ in range(batch - 1)]
    params = [mixed_params(rng) for _ in prompts]
    at = rng.randrange(batch)
    prompts.insert(at, prompt)
    params.insert(at, SEEDED)
    outputs = llm.generate(prompts, params)
    assert outputs[at].token_ids == alone
    other = SamplingParams(temperature=1.0, top_p=0.9, seed=2025, max_tokens=16, ignore_eos=True)
    assert llm.generate([prompt], other)[0].token_ids != alone


def teacher_forced_reference(llm: LLM, prompt: list[int], out: list[int], params) -> list[int]:
    """The reference sampler's greedy choice after each prefix of the output."""
    sampler = ReferenceSampler(llm.eos_token_ids)
    chosen = []
    for i in range(len(out)):
        seq = Sequence(prompt, params)
        seq.token_ids += out[:i]
        logits = llm.runner.prompt_logits(prompt + out[:i], last=1)
        chosen.append(int(sampler.processed_logits(logits, [seq]).argmax(-1)))
    return chosen


PENALISED = [
    SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0, frequency_penalty=1.2, max_tokens=14, ignore_eos=True),
    SamplingParams(
        temperature=0, presence_penalty=1.0, repetition_penalty=0.8, max_tokens=14, min_tokens=6
    ),
]


def test_penalised_greedy_equals_the_reference_sampler(llm):
    prompts = [[7, 7, 7, 12, 9], [1, 2, 3, 4, 5, 6, 7, 8], [300, 200, 100]]
    outputs = llm.generate(prompts, PENALISED)
    for prompt, params, out in zip(prompts, PENALISED, outputs):
        expected = teacher_forced_reference(llm, prompt, out.token_ids, params)
        assert out.token_ids == expected


def test_preemption_keeps_penalties_seeds_and_logprobs(tiny_model):
    """A pool so small that sequences are preempted and recomputed: the token counts, seeds
    and output positions are rebuilt, so every output equals an unconstrained run's."""
    rng = random.Random(0)
    prompts = [random_prompt(rng, 400) for _ in range(12)]
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=10, seed=11, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, frequency_penalty=0.7, max_tokens=30, logprobs=2),
    ] * 4
    roomy = LLM(str(tiny_model[0]), num_kv_blocks=256, block_size=8, progress=False)
    tight = LLM(str(tiny_model[0]), num_kv_blocks=24, block_size=8, progress=False)
    expected = roomy.generate(prompts, params)
    got = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for a, b in zip(got, expected):
        if b.logprobs is not None:
            assert [e.token_id for e in a.logprobs] == a.token_ids
            # Other batch compositions: equal to float32 noise.
            assert [e.logprob for e in a.logprobs] == pytest.approx(
                [e.logprob for e in b.logprobs], abs=1e-5
            )


def test_logprobs_equal_the_log_softmax_of_the_logits(llm):
    prompt = [11, 22, 33, 44, 55, 66]
    params = SamplingParams(
        temperature=0.8, seed=1, max_tokens=6, logprobs=4, prompt_logprobs=3, ignore_eos=True
    )
    out = llm.generate([prompt], params)[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    full = prompt + out.token_ids
    ref = torch.log_softmax(llm.runner.prompt_logits(full[:-1]), dim=-1)
    for i, entry in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert entry.token_id == out.token_ids[i]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-5)
        assert entry.rank == int((row > row[entry.token_id]).sum()) + 1
        top = row.topk(4)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        row = ref[pos - 1]
        assert entry.token_id == prompt[pos] and len(entry.top) == 3
        assert entry.logprob == pytest.approx(row[prompt[pos]].item(), abs=1e-5)


def test_prompt_logprobs_across_prefill_chunks(tiny_model):
    chunked = LLM(
        str(tiny_model[0]), num_kv_blocks=64, block_size=8, max_num_batched_tokens=16,
        progress=False,
    )  # fmt: skip
    prompt = list(range(40, 90))
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    out = chunked.generate([prompt], params)[0]
    ref = torch.log_softmax(chunked.runner.prompt_logits(prompt), dim=-1)
    got = [e.logprob for e in out.prompt_logprobs[1:]]
    want = [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
    assert got == pytest.approx(want, abs=1e-5)
    assert all(e.top == [] for e in out.prompt_logprobs[1:])


def test_streamed_logprobs_match_generate(llm):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    expected = llm.generate([[9, 8, 7]], params)[0]
    chunks = list(llm.stream([[9, 8, 7]], params))
    streamed = [e for c in chunks for e in (c.logprobs or [])]
    assert [e.token_id for e in streamed] == expected.token_ids
    assert [e.logprob for e in streamed] == [e.logprob for e in expected.logprobs]


def test_no_logprobs_unless_asked(llm):
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.logprobs is None and out.prompt_logprobs is None


def test_prompt_logprobs_skip_the_prefix_cache(tiny_model):
    """A cached prompt still gets every prompt position's entry."""
    llm = LLM(str(tiny_model[0]), num_kv_blocks=64, block_size=8, progress=False)
    prompt = list(range(100, 140))
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))  # now cached
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    out = llm.generate([prompt], params)[0]
    assert len(out.prompt_logprobs) == len(prompt)
    ref = torch.log_softmax(llm.runner.prompt_logits(prompt), dim=-1)
    got = [e.logprob for e in out.prompt_logprobs[1:]]
    assert got == pytest.approx([ref[p - 1, prompt[p]].item() for p in range(1, 40)], abs=1e-5)
    # Without prompt logprobs the same prompt does hit the cache.
    before = llm.stats()["prefix_cache_hits"]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))
    assert llm.stats()["prefix_cache_hits"] > before
