"""Why the custom all-reduce would hang inside a CUDA graph: one replay, watched from outside.

Each of two ranks runs a few all-reduces (three sizes the custom kernel takes, and with
`nccl` one over its size limit, which goes to NCCL), either eagerly or captured in a CUDA
graph and replayed once. Then, without synchronizing the compute stream, it copies the
kernel's per-program epochs and flags to the host every two seconds on a side stream and
prints them with the status words (ABORT, ERROR): a program stuck waiting shows which epoch it
waits for and which flag its peer last wrote. faulthandler ends a rank stuck past 100 s.

    NANOQWEN_ALL_REDUCE_TIMEOUT_S=10 python3 tools/allreduce_probe.py graph nccl
    python3 tools/allreduce_probe.py graph nonccl     # the custom kernel alone in the graph
    python3 tools/allreduce_probe.py eager nccl
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time

import torch
import torch.multiprocessing as mp

from nanoqwen.runtime.parallel.custom_all_reduce import max_bytes_for
from nanoqwen.runtime.parallel.group import join_group, spawn_store

WORLD = 2
WATCH_S = 40


class Watcher:
    """Host copies of the kernel's state and flags, taken on a side stream."""

    def __init__(self, custom, rank: int, device: torch.device) -> None:
        self.custom, self.rank = custom, rank
        self.side = torch.cuda.Stream(device)
        self.state = torch.empty(custom.state.numel(), dtype=torch.int64).pin_memory()
        self.flags = torch.empty(custom.flags.numel(), dtype=torch.int64).pin_memory()
        self.t0 = time.time()

    def print(self, tag: str) -> None:
        with torch.cuda.stream(self.side):
            self.state.copy_(self.custom.state, non_blocking=True)
            self.flags.copy_(self.custom.flags, non_blocking=True)
        self.side.synchronize()
        g = self.custom.g_max
        print(
            f"[rank {self.rank} {tag} {time.time() - self.t0:5.1f} s] "
            f"epochs[:8] {self.state[:8].tolist()} failed {int(self.state[g])} "
            f"flags[:8] {self.flags.view(g, WORLD)[:8].tolist()} "
            f"status {self.custom.status_words.tolist()}",
            flush=True,
        )


def rank_main(rank: int, port: int, mode: str, with_nccl: bool) -> None:
    faulthandler.dump_traceback_later(100, exit=True)
    os.environ.setdefault("NANOQWEN_ALL_REDUCE_TIMEOUT_S", "10")
    os.environ["NANOQWEN_CUSTOM_ALL_REDUCE"] = "1"
    ctx = join_group(rank, WORLD, torch.device("cuda", rank), spawn_store(WORLD, port))
    device, tp, custom = ctx.device, ctx.tp, ctx.tp.custom_all_reduce
    assert custom is not None, "the custom all-reduce was refused on this machine"
    sizes = [1, 3584, 7 * 1025] + ([max_bytes_for(WORLD) // 2 + 8] if with_nccl else [])
    inputs = [torch.full((n,), rank + 1.0, dtype=torch.bfloat16, device=device) for n in sizes]
    outputs = [torch.empty_like(x) for x in inputs]

    def step() -> None:
        for x, out in zip(inputs, outputs):
            out.copy_(x)
            tp.all_reduce(out)

    step()  # the warm-up: compiles the kernel before any capture
    torch.cuda.synchronize()
    watch = Watcher(custom, rank, device)
    watch.print("after warm-up")
    if mode == "graph":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            step()
        watch.print("captured")
        graph.replay()
    else:
        step()
    done = torch.cuda.Event()
    done.record()
    watch.t0 = time.time()
    while not done.query() and time.time() - watch.t0 < WATCH_S:
        watch.print("running")
        time.sleep(2)
    finished = done.query()
    watch.print("finished" if finished else "STILL RUNNING")
    right = [bool((o.float() == 3.0).all()) for o in outputs] if finished else "not read"
    print(f"[rank {rank}] finished {finished}, sums right {right}, error {custom.error()}")
    os._exit(0)  # no NCCL teardown: a stuck peer would block it


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "graph"
    with_nccl = (sys.argv[2] if len(sys.argv) > 2 else "nccl") == "nccl"
    store = spawn_store(WORLD)  # the ranks' rendezvous, held here while they run
    mp.spawn(rank_main, args=(store.port, mode, with_nccl), nprocs=WORLD)
