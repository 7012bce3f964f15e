"""The prefill graphs' padded layout (runtime/prefill_graph.py), checked on the CPU: the
steps the graphs capture (a lone prompt, running streams' tokens beside prompt chunks), run
eagerly over the graphs' own buffers with the torch backend."""

from __future__ import annotations

import pytest
import torch

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.launched_step import PLACEHOLDER
from nanoqwen.runtime.prefill_graph import PrefillGraphRunner, buckets
from nanoqwen.runtime.scheduler import Batch
from nanoqwen.runtime.sequence import Sequence

LONG_PROMPT = [(7 * i) % 500 + 3 for i in range(300)]
SHORT = [[5, 6, 7, 8], [40, 41, 42], [100, 200, 300, 301, 302]]


class EagerPrefillGraphs(PrefillGraphRunner):
    """Replays run what the graph of the key would have captured, eagerly."""

    def __init__(self, runner, max_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        super().__init__(max_tokens, max_num_seqs, runner.kv, runner.sampler.state.scratch)
        self.setup(runner, max_model_len)
        self.graphs = dict.fromkeys(self.keys())
        self.replayed: list[tuple[int, int, bool]] = []

    def replay(self, key):
        self.replayed.append(key)
        with torch.inference_mode():
            return self.forward(key)


def engine(model_dir, graphs: bool, **options) -> LLM:
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=64, progress=False, **options)
    if graphs:
        runner, config = llm.runner, llm.scheduler.config
        longest = min(config.max_num_batched_tokens, llm.max_model_len)
        runner.prefill_graphs = EagerPrefillGraphs(
            runner, longest, config.max_num_seqs, llm.max_model_len
        )
    return llm


def test_buckets_hold_every_step_the_scheduler_can_send_up_to_512_tokens():
    assert buckets(8192) == [16, 32, 64, 128, 256, 512]
    assert buckets(512) == [16, 32, 64, 128, 256, 512]
    assert buckets(100) == [16, 32, 64, 128]
    assert buckets(64) == [16, 32, 64]
    assert buckets(15) == [16]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return engine(tiny_model[0], graphs=True, max_num_seqs=40)


@pytest.mark.parametrize(("bucket", "rows"), [(16, 1), (16, 16), (64, 40), (512, 40)])
def test_each_bucket_warms_up_on_its_own_rows_and_the_scratch_block(llm, bucket, rows):
    """A warm-up layout naming rows past the bucket's would have its kernels read and write
    past the end of their tensors."""
    graphs = llm.runner.prefill_graphs
    assert graphs.logit_rows(bucket) == sorted({1, min(bucket, 40)})
    graphs._warm_up_inputs(bucket, rows)
    scratch = llm.runner.kv.scratch_block
    f, cap = graphs.fields, min(bucket, 40) + 1
    assert f.cu_q[: cap + 1].tolist() == [0] + [bucket] * cap
    assert f.cu_k[: cap + 1].tolist() == [0] + [bucket] * cap
    assert f.ctx[:cap].tolist() == [bucket] + [0] * (cap - 1)
    assert f.pos[:bucket].tolist() == list(range(bucket))
    assert set(f.tables[:cap].flatten().tolist()) == {scratch}
    assert set((f.slots[:bucket] // 16).tolist()) == {scratch}
    assert f.logit_rows[:rows].tolist() == [0] * rows
    assert f.sampler_slots[:rows].tolist() == [llm.runner.sampler.state.scratch] * rows


def test_a_mixed_step_lays_out_decodes_chunks_and_padding(llm):
    """Two running sequences (one with its newest token still in flight) beside a prompt
    chunk that completes and one that does not: the 16-token bucket, whose logit rows are the
    completing sequences' last rows and whose placeholders name their source rows."""
    runner = llm.runner
    a = Sequence([1, 2, 3, 4, 9], SamplingParams())  # running: 4 computed, feeds token 9
    b = Sequence([5, 6, 7, PLACEHOLDER], SamplingParams())
    c = Sequence([20, 21, 22, 23], SamplingParams())  # a prompt, completes
    d = Sequence(list(range(30, 50)), SamplingParams())  # a long prompt, first 6 tokens
    for seq, done in ((a, 4), (b, 3), (c, 0), (d, 0)):
        runner.blocks.grow(seq, len(seq))
        seq.num_computed_tokens = done
    try:
        batch = Batch([a, b, c, d], True, [1, 1, 4, 6])
        graphs = runner.prefill_graphs
        assert graphs.bucket(batch) == 16
        key = graphs.prepare(batch, 16, [0, 3, 0, 0], [11, 12, 13], filtering=False)
        assert key == (16, 16, False)
        f, cap = graphs.fields, 17
        assert f.ids[:16].tolist() == [9, PLACEHOLDER, 20, 21, 22, 23, *range(30, 36), 0, 0, 0, 0]
        assert f.pos[:16].tolist() == [4, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
        assert f.sources[:16].tolist() == [0, 3] + [0] * 14
        assert f.cu_q[: cap + 1].tolist() == [0, 1, 2, 6, 12] + [16] * 13
        assert f.cu_k[: cap + 1].tolist() == [0, 5, 9, 13, 19] + [23] * 13
        assert f.ctx[:cap].tolist() == [5, 4, 4, 6, 4] + [0] * 12
        assert f.logit_rows[:16].tolist() == [0, 1, 5] + [0] * 13
        scratch_slot = runner.sampler.state.scratch
        assert f.sampler_slots[:16].tolist() == [11, 12, 13] + [scratch_slot] * 13
        table = a.block_table[0]
        assert f.slots[0] == table * 16 + 4
        assert set((f.slots[12:16] // 16).tolist()) == {runner.kv.scratch_block}
    finally:
        for seq in (a, b, c, d):
            runner.blocks.free(seq)


def test_a_padded_chunk_after_a_cached_prefix_gives_the_eager_logits(llm):
    """A 50-token prompt whose first 30 tokens are already in the cache: its last 20 run in
    the 32-token bucket with 12 padding rows. The logits must be the eager step's, and the
    padding must write nothing but the scratch block."""
    runner, kv = llm.runner, llm.runner.kv
    graphs = runner.prefill_graphs
    seq = Sequence([(7 * j) % 397 for j in range(50)], SamplingParams())
    runner.blocks.grow(seq, len(seq))
    try:
        runner.prefill_graphs = None
        runner.execute(Batch([seq], True, [30]))
        seq.num_computed_tokens = 30
        eager = runner.compute_logits(Batch([seq], True, [20])).clone()
        before = torch.stack(kv.k + kv.v)  # [2 x layers, blocks, ...]
        runner.prefill_graphs = graphs
        padded = runner.compute_logits(Batch([seq], True, [20]))
        assert graphs.replayed[-1] == (32, 1, False)
        torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
        assert torch.equal(padded.argmax(-1), eager.argmax(-1))
        after = torch.stack(kv.k + kv.v)
        others = torch.ones(after.shape[1], dtype=torch.bool)
        others[kv.scratch_block] = False
        others[seq.block_table] = False
        assert torch.equal(after[:, others], before[:, others])
        own = seq.block_table
        torch.testing.assert_close(after[:, own], before[:, own], rtol=1e-5, atol=1e-5)
    finally:
        runner.prefill_graphs = graphs
        runner.blocks.free(seq)


def test_steps_of_up_to_512_tokens_and_the_buckets_sequences_replay(llm):
    graphs = llm.runner.prefill_graphs

    def batch(lengths, chunks, **params):
        seqs = [Sequence(list(range(n)), SamplingParams(**params)) for n in lengths]
        return Batch(seqs, True, chunks)

    assert graphs.bucket(batch([512], [512])) == 512
    assert graphs.bucket(batch([1], [1])) == 16
    assert graphs.bucket(batch([40], [20])) == 32  # a chunk mid-prompt samples nothing
    assert graphs.bucket(batch([10, 10], [10, 10])) == 32
    assert graphs.bucket(batch([1] * 16, [1] * 16)) == 16  # 16 sequences, capacity 17
    assert not graphs.can_run(batch([600], [513]))
    assert not graphs.can_run(batch([10], [10], prompt_logprobs=2))
    assert not graphs.can_run(Batch([Sequence([1, 2], SamplingParams())], False, [1]))


def test_streams_and_a_long_prompt_in_mixed_graphs_keep_every_token(tiny_model):
    """Streams (greedy, seeded with top-p, penalised with logprobs) decode while a long
    prompt is prefilled in chunks beside them: every mixed step replays a graph, and each
    request's output is what it is alone, with the KV blocks all free at the end."""
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=40, ignore_eos=True),
        SamplingParams(
            temperature=0, presence_penalty=0.7, max_tokens=40, logprobs=2, ignore_eos=True
        ),
    ]
    llm = engine(tiny_model[0], graphs=True, max_num_batched_tokens=64)
    graphs = llm.runner.prefill_graphs
    streams = [llm.add_request(p, sp) for p, sp in zip(SHORT, params)]
    while any(s.num_output_tokens < 3 for s in streams):
        llm.step()
    long = llm.add_request(LONG_PROMPT, SamplingParams(temperature=0, max_tokens=5))
    replays = len(graphs.replayed)
    mixed = 0
    while long.first_token_time is None:
        made = {seq.seq_id for seq, _ in llm.step()}
        mixed += 1
        assert all(s.seq_id in made for s in streams), "a running stream got no token"
    assert mixed >= 300 // 64
    # Every mixed step of 64 tokens replays the bucket of 64 with a logit row per sequence.
    assert graphs.replayed[replays:].count((64, 64, True)) >= mixed - 1
    while llm.scheduler.has_unfinished():
        llm.step()
    llm.drain()
    alone = engine(tiny_model[0], graphs=False)
    for seq, prompt in zip([*streams, long], [*SHORT, LONG_PROMPT]):
        want = alone.generate([prompt], seq.params)[0]
        assert seq.output_token_ids == want.token_ids
        if seq.params.logprobs:
            assert [lp.token_id for lp in seq.logprobs] == want.token_ids
            got = torch.tensor([lp.logprob for lp in seq.logprobs])
            ref = torch.tensor([lp.logprob for lp in want.logprobs])
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    assert llm.scheduler.blocks.num_free_blocks == llm.scheduler.blocks.num_blocks
