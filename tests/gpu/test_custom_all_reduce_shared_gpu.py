"""The custom all-reduce's protocol on a one-GPU machine: two processes share cuda:0 and map
each other's buffers over CUDA IPC, as two ranks on two GPUs do (the engine refuses a shared
GPU, so the ranks build CustomAllReduce themselves, over gloo, with no NCCL).

Without MPS the GPU runs one process's kernel at a time and switches on its time slice, so a
rank's kernel spins until its peer's context gets the GPU: every call costs about a time
slice (~2 ms) and nothing here is timed. What it shows on every GPU check, two GPUs or not:
the barriers and epochs hold for calls queued back to back and for CUDA-graph replays (where
warps that disagree on leaving a wait loop would hang), with exact sums and no wait given up.
"""

from __future__ import annotations

import faulthandler
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoqwen.runtime.parallel.custom_all_reduce import CustomAllReduce, max_bytes_for
from nanoqwen.runtime.parallel.group import keep_multicast_off, spawn_store

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
WORLD = 2
HIDDEN = 3584  # 7B: one decode token's all-reduce
LAYER_CALLS = 57  # a 7B decode step: two per layer and one more
VOCAB_SHARD = 152064 // WORLD


def join(rank: int, port: int) -> CustomAllReduce:
    faulthandler.dump_traceback_later(150, exit=True)  # a hang fails the test, loudly
    keep_multicast_off()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", store=spawn_store(WORLD, port), rank=rank, world_size=WORLD)
    programs = torch.cuda.get_device_properties(device).multi_processor_count
    return CustomAllReduce(
        rank, WORLD, device, dist.group.WORLD, programs, max_bytes_for(WORLD),
        timeout=timedelta(seconds=30),
    )  # fmt: skip


def expected(mine: torch.Tensor) -> torch.Tensor:
    """Every rank's input summed in float32 in rank order, rounded once (over gloo)."""
    inputs = [torch.empty(mine.shape) for _ in range(WORLD)]
    dist.all_gather(inputs, mine.float().cpu())  # bfloat16 to float32 is exact
    return sum(inputs, torch.zeros(mine.shape)).to(mine.dtype)


def protocol_rank(rank: int, port: int) -> None:
    custom = join(rank, port)
    device = custom.device
    gen = torch.Generator().manual_seed(1234 + rank)
    limit = custom.max_bytes // 2

    def rand(n: int) -> torch.Tensor:
        return torch.randn(n, generator=gen).to(torch.bfloat16).to(device)

    # Queued with no sync between them: a rank may run calls ahead of the other.
    sizes = [1, 7, 1025, HIDDEN, 7 * HIDDEN + 1, 65537, limit - 1, limit] * 4
    inputs = [rand(n) for n in sizes]
    outputs = [x.clone() for x in inputs]
    for out in outputs:
        assert custom(out)
    torch.cuda.synchronize()
    for inp, out in zip(inputs, outputs):
        assert torch.equal(out.cpu(), expected(inp)), inp.numel()

    # One 7B decode step's all-reduces captured in a graph, replayed over new inputs.
    inputs = [torch.zeros(HIDDEN, dtype=torch.bfloat16, device=device) for _ in range(LAYER_CALLS)]
    outputs = [torch.empty_like(x) for x in inputs]

    def step() -> None:
        for x, out in zip(inputs, outputs):
            out.copy_(x)
            custom(out)

    step()  # compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(10):
        for x in inputs:
            x.copy_(rand(HIDDEN))
        graph.replay()
        torch.cuda.synchronize()
        assert custom.error() is None, custom.error()
        for inp, out in zip(inputs, outputs):
            assert torch.equal(out.cpu(), expected(inp))
    assert custom.error() is None, custom.error()
    fused_norm_replays(custom, rand)
    dist.barrier()
    dist.destroy_process_group()


def fused_norm_replays(custom: CustomAllReduce, rand) -> None:
    """A 7B decode step's collectives as the graph runs them: the broadcast of rank 0's
    inputs, the all-reduces each fused with the residual add and RMSNorm after it
    (kernels/triton/all_reduce_norm.py), then the logits' all-gather, replayed over new inputs: the
    inputs rank 0's, the residual stream exact, the normalized rows within an ulp of HF's
    order, every rank's logits in rank order."""
    device, eps = custom.device, 1e-6
    graph_inputs = torch.zeros(1200, dtype=torch.int64, device=device)
    gen = torch.Generator().manual_seed(99 + custom.rank)  # each rank sends its own
    logits = torch.zeros(1, VOCAB_SHARD, dtype=torch.bfloat16, device=device)
    gathered = torch.empty(WORLD, VOCAB_SHARD, dtype=torch.bfloat16, device=device)
    weight = (1 + 0.1 * rand(HIDDEN)).view(1, HIDDEN)
    inputs = [torch.zeros(1, HIDDEN, dtype=torch.bfloat16, device=device) for _ in range(56)]
    streams = [torch.zeros_like(x) for x in inputs]
    partial = [torch.empty_like(x) for x in inputs]
    residual = [torch.empty_like(x) for x in inputs]
    outputs: list[torch.Tensor] = []

    def step() -> None:
        assert custom.broadcast(graph_inputs)
        outputs.clear()
        for x, s, p, r in zip(inputs, streams, partial, residual):
            p.copy_(x)
            r.copy_(s)
            assert custom.takes_rms_norm(p, r)
            outputs.append(custom.all_reduce_rms_norm(p, r, weight[0], eps)[0])
        assert custom.all_gather(logits, gathered)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(5):
        for x, s in zip(inputs, streams):
            x.copy_(rand(HIDDEN).view(1, HIDDEN))
            s.copy_(rand(HIDDEN).view(1, HIDDEN))  # each rank checks its own stream's sum
        logits.copy_(rand(VOCAB_SHARD).view(1, -1))
        sent = torch.randint(-(2**62), 2**62, (1200,), generator=gen)
        graph_inputs.copy_(sent)
        graph.replay()
        torch.cuda.synchronize()
        assert custom.error() is None, custom.error()
        dist.broadcast(sent, 0)
        assert torch.equal(graph_inputs.cpu(), sent)
        everyone = [torch.empty(1, VOCAB_SHARD) for _ in range(WORLD)]
        dist.all_gather(everyone, logits.float().cpu())
        assert torch.equal(gathered.cpu(), torch.cat(everyone).to(torch.bfloat16))
        for x, s, r, out in zip(inputs, streams, residual, outputs):
            summed = expected(x)
            stream = (summed.float() + s.cpu().float()).to(torch.bfloat16)
            assert torch.equal(r.cpu(), stream)
            h = stream.float()
            normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)
            want = (normed.float() * weight.cpu().float()).to(torch.bfloat16)
            ulp = 2 * torch.finfo(torch.bfloat16).eps * want.float().abs()
            assert bool(((out.cpu().float() - want.float()).abs() <= ulp).all())


def test_queued_calls_and_graph_replays_sum_exactly_with_two_processes_on_one_gpu():
    store = spawn_store(WORLD)  # the ranks' rendezvous, held here while they run
    mp.spawn(protocol_rank, args=(store.port,), nprocs=WORLD)
