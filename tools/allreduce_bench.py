"""What tensor parallelism's communication costs one batch-1 decode step, per Qwen2.5 shape.

A decode step at tensor_parallel_size N runs 2 all-reduces per layer (o_proj, down_proj) of
[batch, hidden] plus one for the vocabulary-parallel embedding, and one all-gather of the
logits ([batch, vocab / N] per rank). This times each inside a CUDA graph (as the decode graph
runs them: no launch cost), over NCCL and over the custom kernels (runtime/parallel/
custom_all_reduce.py): the all-reduce's one-shot and low-latency kernels and the one it
picks, the all-gather's low-latency kernel, and the low-latency all-reduce fused with the
residual add and RMSNorm after it (against the pair of kernels it replaces), and prints the
per-step totals next to the shape. --sweep then times the all-reduces over message sizes:
where NCCL overtakes is the custom one's limit, where the one-shot kernel overtakes the
low-latency one the latter's.

    python3 tools/allreduce_bench.py --tp 2 --shapes 7B,14B,32B --batch 1 --sweep
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoqwen.model.shapes import shape_config
from nanoqwen.model.tensor_parallel import _all_gather
from nanoqwen.runtime.cuda_graph import used_entries
from nanoqwen.runtime.parallel.custom_all_reduce import CustomAllReduce, ll_max_bytes_from_env
from nanoqwen.runtime.parallel.group import keep_multicast_off, spawn_store
from nanoqwen.runtime.parallel.peer_memory import RankInfo, refusal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import graph_us as _graph_us  # noqa: E402


def graph_us(fn, reps: int = 50, iters: int = 20) -> float:
    # Captured thread-locally: NCCL's watchdog thread queries events during the capture.
    return _graph_us(fn, reps, iters, capture_error_mode="thread_local")


SWEEP_KIB = [4, 16, 64, 256, 512, 1024, 2048, 4096, 8192]
LL_KIB = 1024  # the low-latency kernel is timed up to here


def custom_reducer(rank: int, size: int, dev: torch.device) -> CustomAllReduce:
    """One sized for the sweep's largest message (the engine's stops at max_bytes_for)."""
    control = dist.new_group(backend="gloo")
    infos = [None] * size
    dist.all_gather_object(infos, RankInfo.local(dev), group=control)
    reason = refusal(infos)
    if reason is not None:
        sys.exit(f"the custom all-reduce cannot run here: {reason}")
    programs = min(i.programs for i in infos)
    return CustomAllReduce(
        rank, size, dev, control, programs, max_bytes=SWEEP_KIB[-1] << 10,
        ll_max_bytes=LL_KIB << 10,
    )  # fmt: skip


def protocols_us(custom: CustomAllReduce, x: torch.Tensor) -> dict[str, float]:
    """The custom all-reduce of x through each of its kernels (the low-latency one only up to
    LL_KIB), and through the one the engine's limits pick."""
    chosen = ll_max_bytes_from_env(None)
    out = {}
    for name, limit in (("oneshot_us", 0), ("ll_us", LL_KIB << 10), ("custom_us", chosen)):
        if name == "ll_us" and x.numel() * x.element_size() > limit:
            continue
        custom.ll_max_bytes = limit
        out[name] = round(graph_us(lambda x=x: custom(x)), 2)
    return out


def norm_us(custom: CustomAllReduce, x: torch.Tensor, eps: float) -> dict[str, float]:
    """A row-parallel output's all-reduce and the add + RMSNorm after it: the Triton norm
    alone, the low-latency all-reduce then the norm, and the one fused kernel."""
    from nanoqwen.kernels.triton.rms_norm import rms_norm

    residual, weight = torch.randn_like(x), torch.ones_like(x[0])
    custom.ll_max_bytes = LL_KIB << 10
    if not custom.takes_rms_norm(x, residual):
        return {}
    return {
        "norm_us": round(graph_us(lambda: rms_norm(x, weight, eps, residual)), 2),
        "ll_then_norm_us": round(
            graph_us(lambda: (custom(x), rms_norm(x, weight, eps, residual))), 2
        ),
        "fused_us": round(
            graph_us(lambda: custom.all_reduce_rms_norm(x, residual, weight, eps)), 2
        ),
    }


def measure(rank: int, size: int, port: int, shapes: list[str], batch: int, sweep: bool) -> None:
    keep_multicast_off()
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl", store=spawn_store(size, port), rank=rank, world_size=size, device_id=dev
    )
    custom = custom_reducer(rank, size, dev)
    for name in shapes:
        cfg = shape_config(name)
        x = torch.randn(batch, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
        shard = -(-cfg.vocab_size // size)
        local = torch.randn(batch, shard, dtype=torch.bfloat16, device=dev)
        gathered = torch.empty(size * batch, shard, dtype=torch.bfloat16, device=dev)
        reduce_us = graph_us(lambda x=x: dist.all_reduce(x))
        kernels = protocols_us(custom, x)
        fused = norm_us(custom, x, cfg.rms_norm_eps)
        custom_us = kernels["custom_us"]
        gather_us = graph_us(lambda g=gathered, lo=local: _all_gather(g, lo))
        custom_gather_us = None
        if custom.all_gather(local, gathered):  # the low-latency kernel takes it
            gather = lambda g=gathered, lo=local: custom.all_gather(lo, g)  # noqa: E731
            custom_gather_us = round(graph_us(gather), 2)
        # A batch-1 graph's inputs (16 rows of 128 blocks of 256: the batch-1 bench's graphs).
        inputs = torch.zeros(used_entries(16, 128, 1, False), dtype=torch.int64, device=dev)
        broadcast_us = graph_us(lambda i=inputs: dist.broadcast(i, group_src=0))
        custom_broadcast_us = graph_us(lambda i=inputs: custom.broadcast(i))
        count = 2 * cfg.num_hidden_layers + 1
        if fused and custom_gather_us is not None and rank == 0:
            # A step's collectives and norms as the engine runs them, and with NCCL.
            steps = {
                "nccl_step_ms": count * (reduce_us + fused["norm_us"]) + gather_us + broadcast_us,
                "custom_step_ms": count * fused["fused_us"] + custom_gather_us
                + custom_broadcast_us,
            }  # fmt: skip
            print(json.dumps({k: round(v / 1e3, 3) for k, v in steps.items()}), flush=True)
        if rank == 0:
            row = {
                "shape": name,
                "tp": size,
                "batch": batch,
                "all_reduce_us": round(reduce_us, 2),
                "custom_all_reduce_us": custom_us,
                "custom_kernels_us": kernels,
                "with_norm_us": fused,
                "all_reduces_per_step": count,
                "logits_all_gather_us": round(gather_us, 2),
                "custom_logits_all_gather_us": custom_gather_us,
                "inputs_broadcast_us": round(broadcast_us, 2),
                "custom_inputs_broadcast_us": round(custom_broadcast_us, 2),
                "per_step_ms": round((count * reduce_us + gather_us) / 1e3, 3),
                "custom_per_step_ms": round((count * custom_us + gather_us) / 1e3, 3),
            }
            print(json.dumps(row), flush=True)
    for kib in SWEEP_KIB if sweep else []:
        x = torch.randn(kib << 9, dtype=torch.bfloat16, device=dev)
        row = {"tp": size, "bfloat16_kib": kib}
        row["nccl_us"] = round(graph_us(lambda x=x: dist.all_reduce(x)), 2)
        row |= protocols_us(custom, x)
        if rank == 0:
            print(json.dumps(row), flush=True)
    torch.cuda.synchronize()
    if custom.error() is not None:
        sys.exit(custom.error())
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--shapes", default="7B,14B,32B,72B")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sweep", action="store_true", help="also time both over message sizes")
    a = ap.parse_args()
    if torch.cuda.device_count() < a.tp:
        sys.exit(f"--tp {a.tp} needs {a.tp} GPUs, found {torch.cuda.device_count()}")
    store = spawn_store(a.tp)  # the ranks' rendezvous, held here while they run
    mp.spawn(measure, args=(a.tp, store.port, a.shapes.split(","), a.batch, a.sweep), nprocs=a.tp)


if __name__ == "__main__":
    main()
