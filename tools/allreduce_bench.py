"""What tensor parallelism's communication costs one batch-1 decode step, per Qwen2.5 shape.

A decode step at tensor_parallel_size N runs 2 all-reduces per layer (o_proj, down_proj) of
[batch, hidden] plus one for the vocabulary-parallel embedding, and one all-gather of the
logits ([batch, vocab / N] per rank). This times each inside a CUDA graph (as the decode graph
runs them: no launch cost) over NCCL, and prints the per-step total next to the shape.

    python3 tools/allreduce_bench.py --tp 2 --shapes 7B,14B,32B --batch 1
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoqwen.model.parallel import _all_gather
from nanoqwen.model.shapes import shape_config
from nanoqwen.runtime.parallel.group import free_port, keep_multicast_off


def graph_us(fn, reps: int = 50, iters: int = 20) -> float:
    """GPU µs per call of fn, replayed from a CUDA graph that calls it reps times (as
    tools/gpu_timing.py, but capturing thread-locally: NCCL's watchdog thread queries events
    while the main thread captures)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * reps)


def measure(rank: int, size: int, port: int, shapes: list[str], batch: int) -> None:
    keep_multicast_off()
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, device_id=dev
    )
    for name in shapes:
        cfg = shape_config(name)
        x = torch.randn(batch, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
        shard = -(-cfg.vocab_size // size)
        local = torch.randn(batch, shard, dtype=torch.bfloat16, device=dev)
        gathered = torch.empty(size * batch, shard, dtype=torch.bfloat16, device=dev)
        reduce_us = graph_us(lambda x=x: dist.all_reduce(x))
        gather_us = graph_us(lambda g=gathered, lo=local: _all_gather(g, lo))
        count = 2 * cfg.num_hidden_layers + 1
        if rank == 0:
            row = {
                "shape": name,
                "tp": size,
                "batch": batch,
                "all_reduce_us": round(reduce_us, 2),
                "all_reduces_per_step": count,
                "logits_all_gather_us": round(gather_us, 2),
                "per_step_ms": round((count * reduce_us + gather_us) / 1e3, 3),
            }
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--shapes", default="7B,14B,32B,72B")
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()
    if torch.cuda.device_count() < a.tp:
        sys.exit(f"--tp {a.tp} needs {a.tp} GPUs, found {torch.cuda.device_count()}")
    port = free_port()
    mp.spawn(measure, args=(a.tp, port, a.shapes.split(","), a.batch), nprocs=a.tp)


if __name__ == "__main__":
    main()
