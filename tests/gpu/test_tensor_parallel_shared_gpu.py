"""A whole tensor_parallel_size=2 engine on a one-GPU machine: two ranks on cuda:0, started
as torchrun starts them, with gloo as the group's backend (NCCL refuses two ranks on one
GPU) and every collective of a decode graph on the custom kernels (the graph's broadcast of
its inputs, the all-reduces fused with their norms, the logits' all-gather), which map each
other's buffers over CUDA IPC as on two GPUs.

What it shows on every GPU check, two GPUs or not: the model's ReducingRMSNorm, the custom
gather and broadcast and the engine's graphs work together (graph replay equal to eager,
logprobs as close to float32 as one GPU's), and the ranks leave together at close(). The GPU
switches between the two processes on its time slice: nothing here is timed.
"""

from __future__ import annotations

import faulthandler
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
RANK_TIMEOUT_S = 180
PROMPTS = [[(7 * i + 3 * j) % 997 for j in range(20 + 45 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from conftest import write_tiny_model

    path = tmp_path_factory.mktemp("shared-gpu-tp")
    write_tiny_model(
        path, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=512, num_hidden_layers=3, vocab_size=1000,
    )  # fmt: skip
    return path


def engine(path, tp: int = 1, **kw):
    from nanoqwen import LLM

    opts = dict(device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=96)
    opts |= dict(max_num_seqs=4, swap_space=0, progress=False)
    return LLM(str(path), tensor_parallel_size=tp, **(opts | kw))


def logprobs(llm) -> list[torch.Tensor]:
    return [torch.log_softmax(llm.runner.prompt_logits(p), -1).cpu() for p in PROMPTS]


def on_one_gpu(rank: int, port: int) -> None:
    """What torchrun and a two-GPU machine would give this rank, on cuda:0 over gloo. A
    rank still running after RANK_TIMEOUT_S prints every thread's stack and exits, so a hang
    fails the test with where each rank waits."""
    faulthandler.dump_traceback_later(RANK_TIMEOUT_S, exit=True)
    from nanoqwen.runtime.parallel import custom_all_reduce, launch

    os.environ |= dict(RANK=str(rank), LOCAL_RANK=str(rank), NANOQWEN_CUSTOM_ALL_REDUCE="1")
    os.environ |= dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    launch.rank_device = lambda device, local, size: torch.device("cuda", 0)
    custom_all_reduce.refusal = lambda infos: None  # the ranks share a GPU, knowingly
    init = dist.init_process_group

    def gloo_group(backend, **kw):
        kw.pop("device_id", None)
        init("gloo", **kw)

    dist.init_process_group = gloo_group


def rank_main(rank: int, port: int, path: str) -> None:
    from nanoqwen import SamplingParams

    on_one_gpu(rank, port)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = engine(path, tp=2)  # rank 1 serves rank 0 inside this call, then exits
    custom = llm.runner.model.tp.custom_all_reduce
    assert custom is not None and llm.runner.graphs is not None
    with_graphs = [o.token_ids for o in llm.generate(PROMPTS, params)]
    graphs, llm.runner.graphs = llm.runner.graphs, None
    eager = [o.token_ids for o in llm.generate(PROMPTS, params)]
    llm.runner.graphs = graphs
    assert with_graphs == eager
    two = logprobs(llm)
    # A decode row's all-reduce is the fused one, and the kernels never gave up.
    row = torch.zeros(1, 256, dtype=torch.bfloat16, device="cuda")
    assert custom.takes_rms_norm(row, row.clone())
    assert custom.error() is None and custom.ll_state[0].item() > 0
    llm.close()
    assert not dist.is_initialized()
    # One GPU, float32 and bfloat16, for the comparison.
    kw = dict(dtype="float32", attention_backend="torch", enforce_eager=True)
    reference = logprobs(engine(path, **kw))
    one = logprobs(engine(path))
    for ref, a, b in zip(reference, one, two):
        err_one, err_two = (a - ref).abs().mean(), (b - ref).abs().mean()
        assert err_two <= 1.5 * err_one + 1e-3, (err_one, err_two)


def test_a_tp2_engine_with_custom_collectives_in_its_graphs_on_one_gpu(model_dir):
    with socket.socket() as s:  # a free port for the env:// rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port, str(model_dir)), nprocs=2)


def prefill_rank_main(rank: int, port: int, path: str) -> None:
    """A single prompt's prefill replays a graph on both ranks (rank 0 announces it, the
    graph broadcasts rank 0's inputs): its logits are the eager prefill's, and generate
    gives the eager engine's tokens. Both prefill with the Triton kernel on both ranks
    (the graphs' own; flash-attn's differs by a bf16 step here and there)."""
    from nanoqwen import SamplingParams
    from nanoqwen.attention import triton_backend

    on_one_gpu(rank, port)
    triton_backend.PREFILL_WITH_FLASH_ATTN = False
    llm = engine(path, tp=2, attention_backend="triton")
    runner, graphs = llm.runner, llm.runner.prefill_graphs
    assert graphs is not None and graphs.sizes == [16, 32, 64, 128, 256, 512]
    replayed = []
    replay = graphs.replay
    graphs.replay = lambda key: replayed.append(key) or replay(key)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for length, bucket in ((1, 16), (20, 32), (300, 512), (511, 512)):
        llm._add([(11 * j + length) % 997 for j in range(length)], greedy, detokenize=False)
        b = llm.scheduler.schedule()
        assert b.is_prefill and len(b.seqs) == 1 and graphs.can_run(b)
        with_graph = runner.compute_logits(b).clone()
        assert replayed[-1] == (bucket, False)
        runner.prefill_graphs = None
        eager = runner.compute_logits(b)
        runner.prefill_graphs = graphs
        llm.abort(b.seqs)
        # Other GEMM shapes (the bucket's rows), so not bit for bit; a wrong row, key or
        # broadcast would move these logits by far more.
        torch.testing.assert_close(with_graph, eager, rtol=0.02, atol=0.1)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)
    for params in (greedy, sampled):
        for p in PROMPTS:
            a = llm.generate([p], params)[0].token_ids
            runner.prefill_graphs = None
            b = llm.generate([p], params)[0].token_ids
            runner.prefill_graphs = graphs
            assert a == b, (len(p), params)
    # The sampled pass finds all but the last partial block of each prompt cached.
    assert (
        replayed[-8:] == [(32, False), (128, False), (128, False), (256, False)] + [(16, True)] * 4
    ), replayed
    llm.close()
    assert not dist.is_initialized()


def test_a_tp2_engine_replays_prefill_graphs_on_one_gpu(model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(prefill_rank_main, args=(port, str(model_dir)), nprocs=2)
