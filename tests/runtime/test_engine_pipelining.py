"""The engine launches step N+1 before it reads back step N's tokens."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.launched_step import PLACEHOLDER, rows_in_place
from nanoqwen.runtime.model_runner import ModelRunner


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


def test_rows_in_place_finds_a_batch_decoding_on_in_order():
    P = PLACEHOLDER
    assert rows_in_place([P, P, P], [0, 1, 2]) == 3
    assert rows_in_place([P, P, 0, 0], [0, 1, 0, 0]) == 2  # padding rows after them
    assert rows_in_place([P, P], [1, 0]) == 0  # the batch's order changed
    assert rows_in_place([5, P], [0, 1]) == 0  # a token read back before a placeholder
    assert rows_in_place([P, 5, P], [0, 0, 2]) == 0  # a placeholder after a read-back token
    assert rows_in_place([5, 6], [0, 0]) == 0
    assert rows_in_place([], []) == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, 99)), max_size=8),
    st.lists(st.integers(0, 99), min_size=8, max_size=8),
)
def test_filling_placeholders_in_one_copy_equals_the_general_fill(rows, last):
    """Whatever the ids and rows, the one-copy path (host lists given) leaves the same ids
    as the compare-gather-select path."""
    ids = [PLACEHOLDER if held else token for held, _, token in rows]
    sources = [source if held else 0 for held, source, _ in rows]
    runner = SimpleNamespace(_last_tokens=torch.tensor(last))
    fast, general = torch.tensor(ids, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64)
    dev_sources = torch.tensor(sources, dtype=torch.int64)
    ModelRunner.fill_placeholders(runner, fast, dev_sources, (ids, sources))
    ModelRunner.fill_placeholders(runner, general, dev_sources, None)
    assert fast.tolist() == general.tolist()
    assert PLACEHOLDER not in fast.tolist()


def test_steady_decode_fills_its_ids_in_one_copy(tiny_model, monkeypatch):
    import nanoqwen.runtime.model_runner as model_runner

    found = []
    monkeypatch.setattr(
        model_runner,
        "rows_in_place",
        lambda ids, sources: found.append(rows_in_place(ids, sources)) or found[-1],
    )
    llm = _llm(tiny_model)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate([[5, 6, 7], [9] * 20], params)
    assert [len(o.token_ids) for o in out] == [6, 6]
    # Every decode step after the prefill: both sequences in flight, each in its own row.
    assert found == [2] * 5
