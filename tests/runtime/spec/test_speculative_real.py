"""Prompt lookup on the real Coder-0.5B in float32: asked to hand a Python file back with one
change, greedy speculative output equals plain output token for token, with most proposals
accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanoqwen import LLM, SamplingParams

WORKLOAD = Path(__file__).resolve().parents[3] / "tools" / "data" / "code_edit.json"


@pytest.mark.real_model
def test_prompt_lookup_keeps_the_real_models_greedy_answer(real_model_dir):
    item = json.loads(WORKLOAD.read_text())[2]
    messages = [{"role": "user", "content": f"{item['instruction']}. Answer with the whole "
                 f"changed file.\n\n```python\n{item['code']}```"}]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=96)
    options = dict(dtype="float32", num_kv_blocks=16, progress=False)
    plain = LLM(str(real_model_dir), **options).chat(messages, params)[0].output
    spec = LLM(
        str(real_model_dir),
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 6,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },  # fmt: skip
        **options,
    )
    got = spec.chat(messages, params)[0].output
    assert got.token_ids == plain.token_ids
    stats = spec.stats()
    assert stats["spec_acceptance_rate"] > 0.5, stats
    assert stats["spec_mean_accepted_length"] > 3, stats


@pytest.mark.real_model
def test_the_q4_gguf_drafting_for_its_float_checkpoint_keeps_the_answer(real_model_dir, gguf_path):
    item = json.loads(WORKLOAD.read_text())[0]
    messages = [{"role": "user", "content": f"{item['instruction']}. Answer with the whole "
                 f"changed file.\n\n```python\n{item['code']}```"}]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=64)
    options = dict(dtype="float32", num_kv_blocks=16, progress=False)
    plain = LLM(str(real_model_dir), **options).chat(messages, params)[0].output
    spec = LLM(
        str(real_model_dir),
        speculative_config={
            "method": "draft",
            "model": str(gguf_path),
            "num_speculative_tokens": 4,
        },  # fmt: skip
        **options,
    )
    assert spec.chat(messages, params)[0].output.token_ids == plain.token_ids
    stats = spec.stats()
    assert stats["spec_acceptance_rate"] > 0.7, stats
    assert not spec.speculator.proposer.seqs
