"""Draft-model speculation on tiny random models (float32, CPU): the same model as its own
draft has every proposal accepted, another model almost none, and either way the output is
plain decoding's, token for token; the draft's KV pool follows the target's sequences
through rejections, preemption and finishing, and ends empty."""

from __future__ import annotations

import pytest
from conftest import write_tiny_model
from spec_helpers import PROMPTS, all_blocks_free, engine

from nanoqwen import LLM, InvalidInputError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-draft")
    write_tiny_model(path, seed=1)
    return path


def draft_engine(target, draft, k: int = 4, **options) -> LLM:
    spec = {"method": "draft", "model": str(draft), "num_speculative_tokens": k}
    return engine(target, spec=spec, **options)


def draft_pool_empty(llm: LLM) -> bool:
    proposer = llm.speculator.proposer
    return not proposer.seqs and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


@pytest.fixture(scope="module")
def plain(tiny_model):
    return engine(tiny_model[0], spec=None)


def test_the_model_as_its_own_draft_has_every_proposal_accepted(tiny_model, plain):
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    spec = draft_engine(tiny_model[0], tiny_model[0])
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == expected
    stats = spec.stats()
    assert stats["spec_acceptance_rate"] == 1.0
    assert stats["spec_mean_accepted_length"] > 4.5
    assert all_blocks_free(spec) and draft_pool_empty(spec)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_another_draft_changes_nothing_under_preemption(tiny_model, other_model, plain, mode):
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    spec = draft_engine(tiny_model[0], other_model, k=3, num_kv_blocks=40, preemption_mode=mode)
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    stats = spec.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_proposed_tokens"] > 0
    assert all_blocks_free(spec) and draft_pool_empty(spec)


def test_seeded_sampling_with_a_draft_equals_plain_sampling(tiny_model, plain):
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.0, repetition_penalty=1.2, seed=12, max_tokens=30),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[457]),
    ]
    expected = [o.token_ids for o in plain.generate(PROMPTS[:3], params)]
    spec = draft_engine(tiny_model[0], tiny_model[0])
    assert [o.token_ids for o in spec.generate(PROMPTS[:3], params)] == expected
    assert spec.stats()["spec_accepted_tokens"] > 0
    assert all_blocks_free(spec) and draft_pool_empty(spec)


def test_a_draft_with_another_tokenizer_is_refused(tiny_model, tmp_path):
    write_tiny_model(tmp_path, vocab_size=300)  # a BPE trained to 300 tokens, not 400
    with pytest.raises(InvalidInputError) as e:
        draft_engine(tiny_model[0], tmp_path)
    assert str(e.value) == (
        f"speculative_config.model={str(tmp_path)!r} has another tokenizer than the model: "
        "allowed a draft model with the same tokenizer"
    )
