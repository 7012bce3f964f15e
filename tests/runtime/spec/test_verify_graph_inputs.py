"""The verify graphs' layout (runtime/spec/verify_graph.py), checked on the CPU: the steps the
graphs capture, run eagerly with the torch backend over the same buffer."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import PROMPTS, OracleProposer, all_blocks_free, engine
from test_speculative_engine import SAMPLED, with_length

from nanoqwen import SamplingParams
from nanoqwen.runtime.scheduler import Batch
from nanoqwen.runtime.sequence import Sequence
from nanoqwen.runtime.spec.verify_graph import VerifyGraphRunner

K = 4


class EagerVerifyGraphs(VerifyGraphRunner):
    """Replays run what the graph of the key would have captured, eagerly."""

    def __init__(self, runner, max_num_seqs: int, max_model_len: int) -> None:
        super().__init__(K, max_num_seqs, runner.kv, runner.sampler.state.scratch)
        self.setup(runner, max_model_len)
        self.graphs = {(bs, f): None for bs in self.sizes for f in (False, True)}
        self.replays = 0

    def replay(self, key):
        self.replays += 1
        with torch.inference_mode():
            return self.forward(key)


@pytest.fixture(scope="module")
def plain(tiny_model):
    return engine(tiny_model[0], spec=None)


def test_sizes_stop_at_128_rows_and_the_width_is_k_plus_one(tiny_model):
    llm = engine(tiny_model[0], spec=None)
    assert VerifyGraphRunner(4, 64, llm.runner.kv, 0).sizes == [1, 2, 4, 8, 16]
    assert VerifyGraphRunner(16, 64, llm.runner.kv, 0).sizes == [1, 2, 4]
    assert VerifyGraphRunner(4, 3, llm.runner.kv, 0).sizes == [1, 2, 3]


def test_short_proposals_are_filled_and_padding_sequences_use_only_the_scratch_block(tiny_model):
    """Three sequences with 4, 2 and 0 proposals run in the graph of 4: the real rows'
    logits are the eager verify step's, fillers and padding write only the scratch block,
    and fillers sample in the sampler's scratch slot."""
    llm = engine(tiny_model[0], spec=None)
    runner, kv = llm.runner, llm.runner.kv
    seqs = [Sequence(list(p), SamplingParams(temperature=0)) for p in PROMPTS[:3]]
    proposals = [[9, 10, 11, 12], [44, 45], []]
    for seq, proposal in zip(seqs, proposals):
        runner.blocks.grow(seq, len(seq) + len(proposal))
    runner.sampler.admit(seqs)
    try:
        runner.execute(Batch(seqs, True, [len(s) - 1 for s in seqs]))
        for seq in seqs:
            seq.num_computed_tokens = len(seq) - 1
        batch = Batch(seqs, False, [1, 1, 1], proposals)
        with torch.inference_mode():
            ids, meta, rows = runner.upload(runner.inputs.verify(batch))
            x, residual = runner.model(ids, meta)
            eager = runner.model.compute_logits((x[rows], residual[rows]))
        before = torch.stack(kv.k + kv.v)
        graphs = EagerVerifyGraphs(runner, max_num_seqs=8, max_model_len=256)
        kv_slots = [runner.blocks.slots(s, len(s) - 1, len(s) + len(p))
                    for s, p in zip(seqs, proposals)]  # fmt: skip
        slots = runner.sampler.slots(seqs)
        key = graphs.prepare(seqs, proposals, kv_slots, slots, False)
        assert key == (4, False)
        f, scratch, w = graphs.fields, kv.scratch_block, K + 1
        lens = [len(s) for s in seqs]
        assert f.ids[:w].tolist() == [seqs[0].token_ids[-1], 9, 10, 11, 12]
        assert f.ids[w : 2 * w].tolist() == [seqs[1].token_ids[-1], 44, 45, 0, 0]
        assert f.pos[2 * w : 3 * w].tolist() == list(range(lens[2] - 1, lens[2] - 1 + w))
        assert f.ctx.tolist()[:4] == [n - 1 + w for n in lens] + [w]
        assert f.cu_k.tolist()[:5] == [0, *torch.tensor(f.ctx[:4].tolist()).cumsum(0).tolist()]
        assert set((f.slots[w + 3 : 2 * w] // 8).tolist()) == {scratch}  # seq 1's fillers
        assert set((f.slots[3 * w : 4 * w] // 8).tolist()) == {scratch}  # the padding
        depth = f.sampler_slots.view(w, 8)[:, :4]
        sampler_scratch = runner.sampler.state.scratch
        assert depth[:, 0].tolist() == [slots[0]] * 5
        assert depth[:, 1].tolist() == [slots[1]] * 3 + [sampler_scratch] * 2
        assert depth[:, 2].tolist() == [slots[2]] + [sampler_scratch] * 4
        assert depth[:, 3].tolist() == [sampler_scratch] * 5
        logits, tokens = graphs.replay(key)
        real = [i * w + j for i, p in enumerate(proposals) for j in range(1 + len(p))]
        torch.testing.assert_close(logits[real], eager, rtol=1e-5, atol=1e-5)
        assert tokens.shape == (w, 4)
        for i, p in enumerate(proposals):
            got = tokens[: 1 + len(p), i].tolist()
            assert got == logits[[i * w + j for j in range(1 + len(p))]].argmax(-1).tolist()
        after = torch.stack(kv.k + kv.v)
        others = torch.ones(after.shape[1], dtype=torch.bool)
        others[scratch] = False
        for seq in seqs:
            others[seq.block_table] = False
        assert torch.equal(after[:, others], before[:, others])
    finally:
        for seq in seqs:
            runner.sampler.release(seq)
            runner.blocks.free(seq)


def _with_graphs(llm, max_num_seqs: int = 8) -> EagerVerifyGraphs:
    graphs = EagerVerifyGraphs(llm.runner, max_num_seqs, llm.max_model_len)
    llm.runner.verify_graphs = graphs
    return graphs


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_output_through_the_graph_path_equals_plain_decoding(tiny_model, plain, batch):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS[:batch]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    spec = engine(tiny_model[0], max_num_seqs=8)
    graphs = _with_graphs(spec)
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    assert graphs.replays > 0 and spec.stats()["spec_accepted_tokens"] > 0
    assert all_blocks_free(spec)


def test_seeded_sampling_through_the_graph_path_equals_plain_sampling(tiny_model, plain):
    """Depth by depth in the graph, as verify_rows does eagerly: same noise, penalties over
    the rows before, rows past a rejection taken back, the target's logprobs. logit_bias
    takes the eager path (the batch it is in too)."""
    params = [with_length(p) for p in SAMPLED[:7]]
    expected = plain.generate(PROMPTS[:7], params)
    spec = engine(tiny_model[0], max_num_seqs=8)
    graphs = _with_graphs(spec)
    spec.speculator.proposer = OracleProposer([o.prompt_token_ids + o.token_ids for o in expected])
    got = spec.generate(PROMPTS[:7], params)
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
        for a, b in zip(g.logprobs, e.logprobs):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    stats = spec.stats()
    assert graphs.replays > 0 and 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    assert all_blocks_free(spec)
