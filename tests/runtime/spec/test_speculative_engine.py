"""Speculative decoding through the engine on a tiny random model (float32, CPU): output
equal to plain decoding token for token, greedy and seeded, with every sampling option,
prefix caching, preemption, stop strings and streaming; KV blocks all free at the end."""

from __future__ import annotations

import pytest
from spec_helpers import PROMPTS, OracleProposer, all_blocks_free, engine

from nanoqwen import SamplingParams


@pytest.fixture(scope="module")
def plain(tiny_model):
    return engine(tiny_model[0], spec=None)


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_output_equals_plain_decoding(tiny_model, plain, batch):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS[:batch]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    spec = engine(tiny_model[0])
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    stats = spec.stats()
    assert stats["spec_proposed_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    assert all_blocks_free(spec)


SAMPLED = [
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.0, top_k=20, seed=2),
    SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, seed=3),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=4),
    SamplingParams(temperature=0.9, presence_penalty=0.8, frequency_penalty=0.5, seed=5),
    SamplingParams(temperature=1.2, top_k=50, top_p=0.9, min_tokens=12, max_tokens=36, seed=6),
    SamplingParams(temperature=0, repetition_penalty=1.2),
    SamplingParams(temperature=0.6, seed=7, logit_bias={300: 4.0, 7: -3.0}),
]


def with_length(p: SamplingParams, **extra) -> SamplingParams:
    fields = {k: getattr(p, k) for k in ("temperature", "top_k", "top_p", "min_p", "seed",
              "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens",
              "logit_bias")}  # fmt: skip
    return SamplingParams(**fields | {"max_tokens": 36, "logprobs": 3} | extra)


def test_seeded_sampling_equals_plain_sampling_with_every_option(tiny_model, plain):
    """Every row of a verify step is sampled as the plain step would sample it (same noise,
    penalties counting the rows before it), and rows past a rejection are taken back."""
    params = [with_length(p) for p in SAMPLED]
    expected = plain.generate(PROMPTS, params)
    spec = engine(tiny_model[0])
    spec.speculator.proposer = OracleProposer([o.prompt_token_ids + o.token_ids for o in expected])
    got = spec.generate(PROMPTS, params)
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
        assert [x.token_id for x in g.logprobs] == e.token_ids
        for a, b in zip(g.logprobs, e.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    stats = spec.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    assert stats["spec_mean_accepted_length"] > 2
    assert all_blocks_free(spec)


def test_preemption_and_prefix_caching_keep_the_output(tiny_model, plain):
    """A pool too small for the batch preempts (recomputing, with cached prefixes), and a
    rejected proposal's blocks go back to the pool."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    for mode in ("recompute", "swap"):
        spec = engine(tiny_model[0], num_kv_blocks=40, preemption_mode=mode)
        spec.speculator.proposer = OracleProposer([p + e for p, e in zip(prompts, expected)])
        assert [o.token_ids for o in spec.generate(prompts, params)] == expected
        assert spec.stats()["num_preemptions"] > 0
        assert spec.stats()["spec_accepted_tokens"] > 0
        assert all_blocks_free(spec)


def test_max_tokens_stop_strings_and_streaming_end_where_plain_decoding_ends(tiny_model, plain):
    prompt = PROMPTS[0]
    reference = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=30,
                                                        ignore_eos=True))[0]  # fmt: skip
    stop = reference.text[len(reference.text) // 2 :][:3]
    cases = [
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[reference.token_ids[5]]),
    ]
    spec = engine(tiny_model[0])
    spec.speculator.proposer = OracleProposer([prompt + reference.token_ids], num_tokens=6)
    for params in cases:
        e = plain.generate([prompt], params)[0]
        g = spec.generate([prompt], params)[0]
        assert (g.token_ids, g.text, g.finish_reason) == (e.token_ids, e.text, e.finish_reason)
        pieces = list(spec.stream([prompt], params))
        assert "".join(c.text for c in pieces) == e.text
        assert pieces[-1].finish_reason == e.finish_reason
    assert len(spec.generate([prompt], cases[0])[0].token_ids) == 7
    assert all_blocks_free(spec)


def test_structured_requests_share_a_batch_without_proposals(tiny_model, plain):
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(
            temperature=0, max_tokens=20, structured_output={"regex": "[a-c]{1,30}"}
        ),  # fmt: skip
    ]
    expected = [o.token_ids for o in plain.generate(PROMPTS[:2], params)]
    spec = engine(tiny_model[0])
    assert [o.token_ids for o in spec.generate(PROMPTS[:2], params)] == expected
