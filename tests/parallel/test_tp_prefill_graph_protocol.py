"""Prefill graphs under tensor parallelism, their protocol on the CPU (gloo, two ranks
started as torchrun starts them): rank 0 announces a step's bucket and logit rows, every
rank replays that graph, and the replay's broadcast gives the other rank rank 0's inputs. A
CPU has no CUDA graphs, so each rank's PrefillGraphRunner is replaced by one whose capture
and replay run the graph's forward eagerly over the same static buffers and metadata."""

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
        # Rows with no sequence sample here (a CPU engine has no decode graphs to say where).
        self.sampler_scratch = runner.sampler.state.scratch if runner.sampler else 0
        self.setup(runner, max_model_len)
        for key in self.keys():
            self._warm_up_inputs(key[0], key[1])
            self.forward(key)
            self.graphs[key] = None

    def replay(self, key):
        self.replayed.append(key)
        return self.forward(key)

    replayed: list = []

    def release(self) -> None:
        self.graphs.clear()


def rank_main(rank: int, port: int, path: str) -> None:
    from nanoqwen import LLM, SamplingParams
    from nanoqwen.runtime import builder

    os.environ |= dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    os.environ |= dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    builder._prefill_graphs = lambda graphs, backend, kv, longest, max_num_seqs: EagerPrefillGraphs(
        longest, max_num_seqs, kv, 0
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
    for length, bucket in ((1, 16), (20, 32), (100, 128), (128, 128)):
        llm._add([(11 * j + length) % 500 for j in range(length)], greedy, detokenize=False)
        b = llm.scheduler.schedule()
        assert graphs.can_run(b)
        with_graph = runner.compute_logits(b).clone()
        assert graphs.replayed[-1] == (bucket, 1, False)
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
    assert graphs.replayed[-2:] == [(16, 1, True), (16, 1, True)], graphs.replayed
    # Two prompts in one step: the graph with a logit row for each sequence the bucket holds.
    prompts = [[1, 2, 3], list(range(5, 25))]
    a = [o.token_ids for o in llm.generate(prompts, sampled)]
    assert (32, 4, True) in graphs.replayed
    runner.prefill_graphs = None
    b = [o.token_ids for o in llm.generate(prompts, sampled)]
    runner.prefill_graphs = graphs
    assert a == b
    llm.close()


def test_both_ranks_replay_the_bucket_rank_zero_announces(tiny_model):
    with socket.socket() as s:  # a free port for the env:// rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port, str(tiny_model[0])), nprocs=2)
