"""Where one decode step's time goes: GPU time of the captured graph vs the CPU around it.

Usage: python tools/profile_decode.py --shape 0.5B [--max-model-len N] [--batch-sizes 1,64]
    [--quantization int4]
Prints, per batch size: the whole engine step (median), the graph replay alone (CUDA
events), the CPU phases of a step, and with --kernels the heaviest kernels of one replay
and each kernel's share of the replay's critical path (the part a step pays for it when
kernels overlap, as programmatic dependents do at batch 1), with a run of one replay's
kernels in order, and what the device runs between replays in engine steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from nanoqwen import LLM, SamplingParams
from nanoqwen.bench.workloads import PRESETS
from nanoqwen.kernels.triton import pdl
from nanoqwen.quant.scheme import QUANTIZATIONS


def median_ms(fn, n: int = 100) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def replay_ms(graph, n: int = 200) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        graph.replay()
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def device_events(prof) -> list[tuple[float, float, str]]:
    """(start, end, name) of every device op the profiler recorded, in start order."""
    return sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.profiler.function_events
        if e.device_type == torch.autograd.DeviceType.CUDA
    )


def critical_path(prof, replays: int, rows: int = 16) -> str:
    """Each kernel's share of the replays' end-to-end time: how far its end lies past the
    latest end before it. Kernels that overlap the one in front (programmatic dependents)
    count only their exposed tail, which is what a step pays for them."""
    kernels = device_events(prof)
    exposed: dict[str, list[float]] = {}
    latest = kernels[0][0] if kernels else 0.0
    sequence = []
    for start, end, name in kernels:
        tail = max(0.0, end - latest)
        exposed.setdefault(name[:70], []).append(tail)
        sequence.append(f"{start - latest:+8.1f} {end - start:7.1f} {tail:7.1f}  {name[:60]}")
        latest = max(latest, end)
    total = sum(sum(v) for v in exposed.values()) / replays
    lines = [f"critical path of one replay {total:.1f} us (gaps count to the kernel after them)"]
    for name, v in sorted(exposed.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        lines.append(f"{sum(v) / replays:9.1f} us {len(v) // replays:5d}x  {name}")
    per_replay = len(kernels) // replays
    lines.append("a run of one replay's kernels: start past the latest end, own time, exposed")
    lines += sequence[per_replay * 2 + 20 : per_replay * 2 + 40]
    lines += sequence[per_replay * 3 - 10 : per_replay * 3]
    return "\n".join(lines)


def outside_graph(prof, graph_kernels: set[str], steps: int) -> str:
    """What the device runs between replays over `steps` engine steps: every device op that
    is not one of the graph's kernels (copies, kernels launched one by one), a step's share,
    and how long the device sat idle (under the profiler, which slows the host)."""
    events = device_events(prof)
    if not events:
        return "no device events recorded"
    ops: dict[str, list[float]] = {}
    idle, latest = 0.0, events[0][1]
    for start, end, name in events:
        idle += max(0.0, start - latest)
        latest = max(latest, end)
        if name not in graph_kernels:
            ops.setdefault(name[:70], []).append(end - start)
    busy = sum(sum(d) for d in ops.values()) / steps
    lines = [
        f"a step outside its graph: device ops {busy:.1f} us, device idle {idle / steps:.1f} us"
    ]
    for name, d in sorted(ops.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{sum(d) / steps:9.1f} us {len(d) / steps:5.1f}x  {name}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="0.5B")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--kernels", action="store_true", help="print the top kernels of a replay")
    p.add_argument("--sampling", default="greedy", choices=PRESETS, help="bench.py's presets")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS)
    args = p.parse_args()
    llm = LLM(random_shape=args.shape, device="cuda", dtype="bfloat16",
              max_model_len=args.max_model_len, quantization=args.quantization,
              progress=False)  # fmt: skip
    graphs = llm.runner.graphs
    print(f"shape {args.shape}, max_model_len {llm.max_model_len}, table width {graphs.width}")
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        params = SamplingParams(max_tokens=10_000, ignore_eos=True, **PRESETS[args.sampling])
        seqs = [llm._add([7] * args.prompt_len, params, False) for _ in range(bs)]
        while llm.scheduler.waiting:
            llm.step()
        for _ in range(5):
            llm.step()
        step = median_ms(llm.step)
        batch = llm.scheduler.schedule()
        phases = {"schedule": lambda: llm.scheduler.schedule()}
        ids, sources, pending = llm.runner.token_sources(batch.seqs)
        slots = llm.runner.sampler.slots(batch.seqs)
        filtering = llm.runner.sampler.filtering
        prepare = partial(graphs.prepare, batch.seqs, ids, sources, slots, filtering)
        phases["prepare+copy"] = prepare
        logits = llm.runner.compute_logits(batch)
        torch.cuda.synchronize()
        slot_rows = torch.tensor(slots, device="cuda")
        phases["sample"] = lambda x=logits, s=slot_rows, f=llm.runner.sampler: f(x, s, f.filtering)
        cpu = {name: median_ms(fn, 50) for name, fn in phases.items()}
        key = prepare()
        if pending:
            # The newest tokens are in flight: as in a step, the runner fills them in on the
            # device (a replay of the ids as sent would read embedding row -1).
            f = graphs.fields
            with torch.inference_mode():
                llm.runner.fill_placeholders(f.ids[:bs], f.sources[:bs], (ids, sources))
        graph = graphs.graphs[key][0]
        gpu = replay_ms(graph)
        print(
            f"bs {bs}: step {step:.3f} ms | graph replay {gpu:.3f} ms | "
            + " | ".join(f"{k} {v:.3f} ms" for k, v in cpu.items())
        )
        if args.kernels:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    graph.replay()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16))
            print(critical_path(prof, 5))
            graph_kernels = {name for _, _, name in device_events(prof)}
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    llm.step()
                torch.cuda.synchronize()
            print(outside_graph(prof, graph_kernels, 20))
            if bs == 1 and pdl.ENABLED:
                print("(batch 1: kernels launched as programmatic dependents count from their "
                      "early start; NANOQWEN_PDL=0 gives each kernel's own time)")  # fmt: skip
        llm.abort(seqs)


if __name__ == "__main__":
    main()
