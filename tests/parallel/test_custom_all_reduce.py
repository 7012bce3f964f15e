"""The custom all-reduce on the CPU: which ranks may use it, the switch in TensorParallel,
and its kernel's protocol (buffers, flags, epochs, parities, timeout, abort) run by Triton's
interpreter in 2 and 3 processes over shared memory, with gloo carrying the handles as it
carries the CUDA IPC handles on GPUs. tests/gpu/test_custom_all_reduce_gpu.py runs it on GPUs.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoqwen.model.tensor_parallel import TensorParallel
from nanoqwen.runtime.parallel import custom_all_reduce, peer_memory
from nanoqwen.runtime.parallel.custom_all_reduce import CustomAllReduce, create, max_bytes_for
from nanoqwen.runtime.parallel.group import spawn_store
from nanoqwen.runtime.parallel.peer_memory import RankInfo, refusal

A, B, C = "GPU-aaaa", "GPU-bbbb", "GPU-cccc"


def info(device: int, host: str = "node0", visible=(A, B, C), peer_access=(True,) * 3):
    return RankInfo(host, device, tuple(visible), tuple(peer_access), programs=132)


def test_ranks_of_one_machine_with_peer_access_may_use_it():
    assert refusal([info(0), info(1), info(2)]) is None


@pytest.mark.parametrize(
    ("infos", "reason"),
    [
        ([info(0), info(1, host="node1")], "several machines"),
        ([info(1), info(1)], "share a GPU"),
        # torchrun with CUDA_VISIBLE_DEVICES set per rank: each sees one GPU, as cuda:0
        ([info(0, visible=(A,)), info(0, visible=(B,))], "does not see rank 1's GPU"),
        ([info(0, peer_access=(True, False, True)), info(1)], "no peer access"),
    ],
)
def test_ranks_that_cannot_map_each_other_keep_nccl(infos, reason):
    assert reason in refusal(infos)


class _Asked(Exception):
    pass


def _ask(*args, **kwargs):
    raise _Asked


def test_switched_on_between_gpus_off_on_the_cpu_alone_or_switched_off(monkeypatch):
    assert custom_all_reduce.DEFAULT_SWITCH == "0"  # off until run on two GPUs
    # Switched on, creating starts by asking this GPU what it is: stopped there, before any
    # collective or CUDA call.
    monkeypatch.setattr(RankInfo, "local", _ask)
    monkeypatch.setenv(custom_all_reduce.SWITCH_ENV, "1")
    with pytest.raises(_Asked):
        create(0, 2, torch.device("cuda", 0), None)
    assert create(0, 2, torch.device("cpu"), None) is None
    assert create(0, 1, torch.device("cuda", 0), None) is None
    for off in ("0", "", "yes"):
        monkeypatch.setenv(custom_all_reduce.SWITCH_ENV, off)
        assert create(0, 2, torch.device("cuda", 0), None) is None
    monkeypatch.delenv(custom_all_reduce.SWITCH_ENV)  # unset: the default
    for default, created in (("0", False), ("1", True)):
        monkeypatch.setattr(custom_all_reduce, "DEFAULT_SWITCH", default)
        if created:
            with pytest.raises(_Asked):
                create(0, 2, torch.device("cuda", 0), None)
        else:
            assert create(0, 2, torch.device("cuda", 0), None) is None


class _SharedCudaTensor:
    """Pickles the way torch shares a CUDA tensor of cuda:1: a call of
    torch.multiprocessing.reductions.rebuild_cuda_tensor with its 15 arguments."""

    ARGS = ("cls", (4,), (1,), 0, "storage", "dtype", 1, b"handle", 16, 0, False, "ref", 0,
            b"event", True)  # fmt: skip

    def __reduce__(self):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor, self.ARGS


def test_peer_buffers_open_under_this_ranks_device(monkeypatch):
    """A peer's IPC handle opened under the peer's device index left rank 0's kernels with no
    mapping of it (an illegal address on two H200s): every argument passes through but
    storage_device, which becomes this rank's."""
    opened = []
    monkeypatch.setattr(peer_memory, "rebuild_cuda_tensor", lambda *a: opened.append(a))
    blob = pickle.dumps([_SharedCudaTensor(), torch.arange(3)])
    _, plain = peer_memory.PeerUnpickler(blob, torch.device("cuda", 0)).load()
    want = list(_SharedCudaTensor.ARGS)
    want[6] = 0
    assert opened == [tuple(want)]
    assert torch.equal(plain, torch.arange(3))  # everything else unpickles as usual


def test_the_size_limit_shrinks_as_ranks_add_reads_and_can_be_set(monkeypatch):
    assert (max_bytes_for(2), max_bytes_for(4), max_bytes_for(8)) == (4 << 20, 512 << 10, 256 << 10)
    monkeypatch.setenv(custom_all_reduce.MAX_BYTES_ENV, "65536")
    assert max_bytes_for(2) == 65536


def test_tensor_parallel_uses_the_group_collective_for_what_the_custom_one_refuses(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None: calls.append(x.numel()))
    taken = []

    def small_only(x: torch.Tensor) -> bool:
        if x.numel() > 4:
            return False
        taken.append(x.numel())
        return True

    tp = TensorParallel(0, 2, None, small_only)
    tp.all_reduce(torch.ones(3))
    tp.all_reduce(torch.ones(5))
    assert (taken, calls) == ([3], [5])
    TensorParallel(0, 2).all_reduce(torch.ones(2))
    assert calls == [5, 2]


# ---- the kernel, in Triton's interpreter, one process per rank -------------------------------
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter"
)
PROGRAMS = 3
MAX_BYTES = 24 * 1024  # 3 regions of 8 KiB: 6,144 float32 or 12,288 float16 elements
# Sizes around the kernel's 1,024-element blocks and up to the limit, in an order that makes
# each program's epoch differ from the others' (small messages use only program 0).
CALLS = [
    (1, torch.float32), (7, torch.float32), (1023, torch.float16), (1024, torch.float32),
    (1025, torch.float32), (3001, torch.float16), (6144, torch.float32), (5, torch.float16),
    (12288, torch.float16), (2048, torch.float32), (3, torch.float32), (4097, torch.float32),
]  # fmt: skip


def join(
    rank: int, world: int, port: int, timeout_s: float, ll_max_bytes: int = MAX_BYTES
) -> CustomAllReduce:
    from conftest import _run_triton_kernels_on_cpu

    _run_triton_kernels_on_cpu()
    mp.set_sharing_strategy("file_system")  # CPU buffers shared by file name, not by fd
    dist.init_process_group("gloo", store=spawn_store(world, port), rank=rank, world_size=world)
    return CustomAllReduce(
        rank, world, torch.device("cpu"), dist.group.WORLD, PROGRAMS, MAX_BYTES,
        timedelta(seconds=timeout_s), ll_max_bytes,
    )  # fmt: skip


def inputs(call: int, n: int, dtype: torch.dtype, world: int) -> list[torch.Tensor]:
    """Every rank's input of a call: each rank can compute the expected sum itself."""
    return [
        torch.randn(n, generator=torch.Generator().manual_seed(1000 * call + q)).to(dtype)
        for q in range(world)
    ]


def sums_rank(rank: int, world: int, port: int, repeats: int, ll_max_bytes: int) -> None:
    reducer = join(rank, world, port, 600, ll_max_bytes)
    results = []
    for i in range(repeats):
        n, dtype = CALLS[i % len(CALLS)]
        xs = inputs(i, n, dtype, world)
        x = xs[rank].clone()
        assert reducer(x)
        want = torch.zeros(n)
        for v in xs:  # float32, in rank order, rounded once: what the kernel does
            want += v.float()
        assert torch.equal(x, want.to(dtype)), (i, n, dtype, (x.float() - want).abs().max())
        results.append(x)
    # What it does not take: too large, float64, strided; left untouched.
    for x in (torch.ones(MAX_BYTES // 4 + 1), torch.ones(4, dtype=torch.float64)):
        assert not reducer(x) and bool((x == 1).all())
    assert not reducer(torch.ones(8, 2)[:, 0])
    assert reducer(torch.ones(0))  # nothing to sum, nothing launched
    assert reducer.error() is None
    everyone = [None] * world
    dist.all_gather_object(everyone, (results, reducer.state.tolist()), group=dist.group.WORLD)
    for other, state in everyone:  # bitwise the same sums, and the same epochs, everywhere
        assert all(torch.equal(a, b) for a, b in zip(other, results))
        assert state == reducer.state.tolist()
    # Which kernel took the calls: the low-latency one those up to its limit in whole
    # 4-byte words, the one-shot one the others (program 0's epochs count its calls).
    low = [n * d.itemsize <= ll_max_bytes and n * d.itemsize % 4 == 0 for n, d in CALLS]
    calls = [low[i % len(CALLS)] for i in range(repeats)]
    taken = (reducer.ll_state[0].item(), reducer.state[0].item())
    assert taken == (sum(calls), repeats - sum(calls))
    dist.destroy_process_group()


@interpreted
@pytest.mark.parametrize(
    ("world", "repeats", "ll_max_bytes"),
    [(2, 2 * len(CALLS), 8192), (3, len(CALLS), 8192), (2, len(CALLS), 0),
     (3, len(CALLS), MAX_BYTES)],
)  # fmt: skip
def test_every_rank_gets_the_same_exact_sum_over_many_calls(world, repeats, ll_max_bytes):
    store = spawn_store(world)
    mp.spawn(sums_rank, args=(world, store.port, repeats, ll_max_bytes), nprocs=world)


def stalled_rank(rank: int, world: int, port: int, abort: bool, ll_max_bytes: int) -> None:
    """Rank 1 never makes the second call: rank 0's kernel must give up, not hang."""
    reducer = join(rank, world, port, 600, ll_max_bytes)
    x = torch.ones(10)
    assert reducer(x) and torch.equal(x, torch.full((10,), 2.0))
    # spins in the interpreter: a fraction of a second
    reducer.timeout = 300
    reducer.ll_buffers = dataclasses.replace(reducer.ll_buffers, timeout=300)
    if rank == 0:
        if abort:
            reducer.abort()
        reducer(x)
        expected = "was aborted" if abort else "waited longer than"
        assert expected in reducer.error(), reducer.error()
        # Once given up it no longer waits: the next call returns at once (void sums).
        reducer(torch.ones(10))
        assert reducer.state[PROGRAMS] != 0
    dist.barrier()
    dist.destroy_process_group()


@interpreted
@pytest.mark.parametrize("ll_max_bytes", [0, MAX_BYTES], ids=["one-shot", "low-latency"])
@pytest.mark.parametrize("abort", [False, True], ids=["timeout", "abort"])
def test_a_rank_that_never_comes_turns_into_an_error_not_a_hang(abort, ll_max_bytes):
    store = spawn_store(2)
    mp.spawn(stalled_rank, args=(2, store.port, abort, ll_max_bytes), nprocs=2)
