"""Prompt lookup on the real Coder-0.5B in float32: asked to hand a Python file back with one
change, greedy speculative output equals plain output token for token, with most proposals
accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanoqwen import LLM, SamplingParams

WORKLOAD = Path(__file__).resolve().parents[3] / "tools" / "data" / "code_edit.json"
OPTIONS = dict(dtype="float32", num_kv_blocks=16, progress=False)


def plain_answer(model_dir, item: int, max_tokens: int):
    """(messages, greedy params, the plain engine's answer) for one code-editing prompt."""
    it = json.loads(WORKLOAD.read_text())[item]
    messages = [{"role": "user", "content": f"{it['instruction']}. Answer with the whole "
                 f"changed file.\n\n```python\n{it['code']}```"}]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return messages, params, LLM(str(model_dir), **OPTIONS).chat(messages, params)[0].output


@pytest.mark.real_model
def test_prompt_lookup_keeps_the_real_models_greedy_answer(real_model_dir):
    messages, params, plain = plain_answer(real_model_dir, 2, 96)
    spec = LLM(
        str(real_model_dir),
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 6,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },  # fmt: skip
        **OPTIONS,
    )
    got = spec.chat(messages, params)[0].output
    assert got.token_ids == plain.token_ids
    stats = spec.stats()
    assert stats["spec_acceptance_rate"] > 0.5, stats
    assert stats["spec_mean_accepted_length"] > 3, stats


@pytest.mark.real_model
def test_the_q4_gguf_drafting_for_its_float_checkpoint_keeps_the_answer(real_model_dir, gguf_path):
    messages, params, plain = plain_answer(real_model_dir, 0, 64)
    spec = LLM(
        str(real_model_dir),
        speculative_config={
            "method": "draft",
            "model": str(gguf_path),
            "num_speculative_tokens": 4,
        },  # fmt: skip
        **OPTIONS,
    )
    assert spec.chat(messages, params)[0].output.token_ids == plain.token_ids
    stats = spec.stats()
    assert stats["spec_acceptance_rate"] > 0.7, stats
    assert not spec.speculator.proposer.seqs
