"""The engine launches step N+1 before it reads back step N's tokens."""

from __future__ import annotations

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.launched_step import PLACEHOLDER


def _llm(tiny_model) -> LLM:
    path, _ = tiny_model
    return LLM(str(path), block_size=16, num_kv_blocks=64, progress=False)


def test_a_step_applies_the_previous_steps_tokens(tiny_model):
    llm = _llm(tiny_model)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seqs = [llm._add([5, 6, 7], params, False), llm._add([9] * 20, params, False)]
    assert llm.step() == []  # prefill launched; nothing read back yet
    assert all(s.token_ids[-1] == PLACEHOLDER for s in seqs)
    first = [s.num_prompt_tokens for s in seqs]
    resolved = llm.step()  # first decode launched, prefill's tokens applied
    assert [s for s, _ in resolved] == seqs
    assert [t for _, t in resolved] == [s.token_ids[p] for s, p in zip(seqs, first)]
    assert all(s.token_ids[-1] == PLACEHOLDER for s in seqs)  # the decode token in flight
    while not all(s.is_finished for s in seqs):
        llm.step()
    assert all(PLACEHOLDER not in s.token_ids for s in seqs)
    assert [len(s.output_token_ids) for s in seqs] == [6, 6]


def test_no_step_is_launched_past_max_tokens(tiny_model):
    llm = _llm(tiny_model)
    launches = []
    launch = llm.runner.launch
    llm.runner.launch = lambda batch: launches.append(len(batch.seqs)) or launch(batch)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].token_ids) == 5
    assert launches == [1] * 5  # one prefill, four decodes: none wasted on a finished request


def test_pipelined_tokens_match_one_step_at_a_time(tiny_model):
    """Penalties force the engine to read each step back before the next; without them it
    runs one step ahead. Same greedy tokens either way when the penalty is neutral-ish."""
    llm = _llm(tiny_model)
    prompts = [[3, 4, 5, 6], [8] * 30, [2]]
    ahead = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    # repetition_penalty 1 + 1e-9 changes no logit's order yet takes the synchronous path.
    sync = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.0 + 1e-9
    )
    in_step = llm.generate(prompts, sync)
    assert [o.token_ids for o in ahead] == [o.token_ids for o in in_step]


def test_a_paused_stream_loses_nothing_when_generate_runs_meanwhile(tiny_model):
    llm = _llm(tiny_model)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate([[4, 5, 6]], params)[0]
    stream = llm.stream([[4, 5, 6]], params)
    chunks = [next(stream)]
    llm.generate([[7, 8, 9, 10]], params)  # runs the engine, and so the paused stream too
    chunks += list(stream)
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids
    assert "".join(c.text for c in chunks) == expected.text
    assert [c.finished for c in chunks].count(True) == 1 and chunks[-1].finished


def test_a_speculative_step_that_proposes_nothing_runs_ahead(tiny_model):
    """Prompt lookup that finds no match costs no wait: the step is launched before the one
    in flight is read back, as in a plain engine."""
    path, _ = tiny_model
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 8,
            "prompt_lookup_max": 8}  # fmt: skip
    llm = LLM(str(path), block_size=16, num_kv_blocks=64, progress=False, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    seq = llm._add(list(range(40, 52)), params, False)
    assert llm.step() == []  # prefill launched
    resolved = llm.step()  # a decode step launched, the prefill's token applied
    assert [s for s, _ in resolved] == [seq]
    assert seq.token_ids[-1] == PLACEHOLDER
    assert llm.speculator.stats.num_verified == 0
    while not seq.is_finished:
        llm.step()
    plain = _llm(tiny_model).generate([list(range(40, 52))], params)[0].token_ids
    assert seq.output_token_ids == plain
