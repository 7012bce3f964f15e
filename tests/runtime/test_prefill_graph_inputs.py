"""The prefill graphs' padded layout (runtime/prefill_graph.py), checked on the CPU: the
same step the graphs capture, run eagerly with the torch backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.prefill_graph import PrefillGraphRunner, buckets
from nanoqwen.runtime.scheduler import Batch
from nanoqwen.runtime.sequence import Sequence


def test_buckets_cover_every_chunk_the_scheduler_can_send_up_to_511_tokens():
    assert buckets(8192) == [16, 32, 64, 128, 256, 512]
    assert buckets(100) == [16, 32, 64, 128]
    assert buckets(16) == [16, 32]
    assert buckets(15) == [16]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model[0]), num_kv_blocks=64, block_size=16, progress=False)


def _graphs(llm, max_tokens=512, max_model_len=1024) -> PrefillGraphRunner:
    graphs = PrefillGraphRunner(max_tokens, llm.runner.kv, sampler_scratch=7)
    graphs._allocate(torch.device("cpu"), max_model_len)
    return graphs


@pytest.mark.parametrize("bucket", [16, 32, 256, 512])
def test_each_bucket_warms_up_on_its_own_rows_and_the_scratch_block(llm, bucket):
    """A warm-up layout naming rows past the bucket's would have its kernels read and write
    past the end of their tensors."""
    graphs = _graphs(llm)
    graphs._warm_up_inputs(bucket)
    scratch = llm.runner.kv.scratch_block
    f = graphs.fields
    assert graphs.rows == 512
    assert f.cu_q.tolist() == [0, 1, bucket] and f.cu_k.tolist() == [0, 1, bucket]
    assert f.ctx.tolist() == [1, bucket - 1]
    assert f.pos[:bucket].tolist() == [0] + list(range(bucket - 1))
    assert set(f.tables.flatten().tolist()) == {scratch}
    assert set((f.slots[:bucket] // 16).tolist()) == {scratch}
    assert f.logit_row.tolist() == [0] and f.sampler_slot.tolist() == [7]


def test_a_padded_chunk_after_a_cached_prefix_gives_the_eager_logits(llm):
    """A 50-token prompt whose first 30 tokens are already in the cache: its last 20 run in
    the 32-token bucket with 12 padding rows. The logits must be the eager step's, and the
    padding must write nothing but the scratch block."""
    runner, kv = llm.runner, llm.runner.kv
    seq = Sequence([(7 * j) % 397 for j in range(50)], SamplingParams())
    runner.blocks.grow(seq, len(seq))
    try:
        runner.execute(Batch([seq], True, [30]))
        seq.num_computed_tokens = 30
        eager = runner.compute_logits(Batch([seq], True, [20])).clone()
        before = torch.stack(kv.k + kv.v)  # [2 x layers, blocks, ...]
        graphs = _graphs(llm)
        table = np.asarray(seq.block_table, dtype=np.int32)
        slot = runner.sampler.slots([seq])[0]
        graphs._fill(graphs.buffer.host(), seq.token_ids[30:], table, 30, 50, slot, 32)
        graphs.buffer.send()
        f = graphs.fields
        assert f.cu_q.tolist() == [0, 20, 32] and f.cu_k.tolist() == [0, 50, 62]
        assert f.ctx.tolist() == [50, 12] and f.logit_row.tolist() == [19]
        assert f.pos[:32].tolist() == list(range(30, 50)) + list(range(12))
        with torch.inference_mode():
            padded = graphs._forward(runner.model, 32, graphs._static_meta(32))
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
        runner.blocks.free(seq)


def test_only_short_single_prompt_completions_without_prompt_logprobs_replay(llm):
    graphs = _graphs(llm)
    graphs.graphs[(32, False)] = None  # captured, as far as can_run is concerned

    def batch(lengths, chunks, **params):
        seqs = [Sequence(list(range(n)), SamplingParams(**params)) for n in lengths]
        return Batch(seqs, True, chunks)

    assert graphs.can_run(batch([511], [511]))
    assert graphs.can_run(batch([1], [1]))
    assert not graphs.can_run(batch([512], [512]))  # no bucket above it
    assert not graphs.can_run(batch([40], [20]))  # a chunk mid-prompt samples nothing
    assert not graphs.can_run(batch([10, 10], [10, 10]))
    assert not graphs.can_run(batch([10], [10], prompt_logprobs=2))
