"""Prefill graphs under tensor parallelism, their protocol on the CPU (gloo, two ranks
started as torchrun starts them): rank 0 announces a single prompt's bucket, every rank
replays it, and the replay's broadcast gives the other rank rank 0's inputs. A CPU has no
CUDA graphs, so each rank's PrefillGraphRunner is replaced by one whose capture and replay
run the graph's forward eagerly over the same static buffers and metadata."""

from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp

from nanoqwen.runtime.prefill_graph import PrefillGraphRunner


class EagerPrefillGraphs(PrefillGraphRunner):
    """capture(): the warm-ups only (their collectives pair across ranks as the real
    capture's do); replay(key): the forward a graph of key would replay."""

    def capture(self, runner, max_model_len: int, pool=None, progress: bool = True) -> None:
        self._allocate(runner.device, max_model_len)
        self.runner = runner
        for bucket in sorted(self.sizes, reverse=True):
            self.meta[bucket] = self._static_meta(bucket)
            for filtering in (False, True):
                self._warm_up_inputs(bucket)
                self._replay_eagerly(bucket, filtering)
                self.graphs[(bucket, filtering)] = None

    def _replay_eagerly(self, bucket: int, filtering: bool):
        meta = self.meta[bucket]
        meta.shared.clear()  # the torch backend's per-step RoPE tables; a graph has none
        logits = self._forward(self.runner.model, bucket, meta)
        sampler = self.runner.sampler
        return logits, sampler(logits, self.fields.sampler_slot, filtering) if sampler else None

    def replay(self, key):
        self.replayed.append(key)
        return self._replay_eagerly(*key)

    replayed: list = []

    def release(self) -> None:
        self.graphs.clear()


def rank_main(rank: int, port: int, path: str) -> None:
    from nanoqwen import LLM, SamplingParams
    from nanoqwen.runtime import builder

    os.environ |= dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    os.environ |= dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    builder._prefill_graphs = lambda graphs, backend, kv, longest: EagerPrefillGraphs(
        longest, kv, 0
    )
    builder._capture = lambda runner, max_len, *_, **__: runner.prefill_graphs.capture(
        runner, max_len
    )
    llm = LLM(path, tensor_parallel_size=2, block_size=8, num_kv_blocks=64, max_num_seqs=4,
              swap_space=0, progress=False)  # fmt: skip
    # Rank 1 served rank 0 inside LLM() and has left.
    runner, graphs = llm.runner, llm.runner.prefill_graphs
    assert graphs.sizes == [16, 32, 64, 128, 256, 512]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for length, bucket in ((1, 16), (20, 32), (100, 128)):
        llm._add([(11 * j + length) % 500 for j in range(length)], greedy, detokenize=False)
        b = llm.scheduler.schedule()
        assert graphs.can_run(b)
        with_graph = runner.compute_logits(b).clone()
        assert graphs.replayed[-1] == (bucket, False)
        runner.prefill_graphs = None
        eager = runner.compute_logits(b)
        runner.prefill_graphs = graphs
        llm.abort(b.seqs)
        torch.testing.assert_close(with_graph, eager, rtol=0, atol=1e-5)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True)
    for params in (greedy, sampled):
        for prompt in ([1, 2, 3], list(range(40))):
            a = llm.generate([prompt], params)[0].token_ids
            runner.prefill_graphs = None
            b = llm.generate([prompt], params)[0].token_ids
            runner.prefill_graphs = graphs
            assert a == b, (len(prompt), params)
    # The second prompt of the sampled pass reads its first 32 tokens from the prefix cache.
    assert graphs.replayed[-2:] == [(16, True), (16, True)], graphs.replayed
    llm.close()


def test_both_ranks_replay_the_bucket_rank_zero_announces(tiny_model):
    with socket.socket() as s:  # a free port for the env:// rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port, str(tiny_model[0])), nprocs=2)
