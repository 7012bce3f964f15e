"""The sampler alone on the GPU: one step per preset and batch size, captured in a CUDA graph,
and with --kernels the top kernels of a replay and the last replay's kernels in order.
Usage: python3 tools/profile_sampler.py [--kernels]

Logits are standard normal times --logit-scales: at 2 (random weights) a top-p 0.9 nucleus holds
~36,000 of 151,936 tokens, at 4 ~800, at 6 ~20 (up to ~140 in a batch of 64), closer to a
trained model's."""

from __future__ import annotations

import argparse

import torch

from nanoqwen import SamplingParams
from nanoqwen.bench.workloads import PRESETS
from nanoqwen.runtime.sampling.sampler import Sampler
from nanoqwen.runtime.sequence import Sequence


def profile(bs: int, scale: float, name: str, vocab: int, kernels: bool) -> None:
    dev = torch.device("cuda")
    logits = torch.randn(bs, vocab, device=dev) * scale
    seqs = [
        Sequence(list(range(1, 200)), SamplingParams(max_tokens=9, **PRESETS[name]))
        for _ in range(bs)
    ]
    sampler = Sampler(frozenset({2}), vocab, bs, dev)
    sampler.admit(seqs)
    slots = torch.tensor(sampler.slots(seqs), device=dev)
    filtering = sampler.filtering
    for _ in range(3):
        sampler(logits, slots, filtering)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sampler(logits, slots, filtering)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        graph.replay()
    start.record()
    for _ in range(100):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    print(f"scale {scale:g} bs {bs} {name}: {start.elapsed_time(end) * 10:.1f} us per step")
    if kernels:
        acts = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
        print_last_step(prof, steps=5)


def print_last_step(prof, steps: int) -> None:
    """The last replay's kernels in launch order: each one's time and the gap before it (the
    launch latency a kernel fewer saves)."""
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    last = kernels[len(kernels) - len(kernels) // steps :]
    end = last[0].time_range.start
    for e in last:
        gap = e.time_range.start - end
        end = e.time_range.end
        print(f"  {e.name[:40]:40s} {e.time_range.elapsed_us():8.1f} us  (gap {gap:5.1f})")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--presets", default="greedy,cli,t0.6,t1-p0.9")
    p.add_argument("--logit-scales", default="2")
    p.add_argument("--kernels", action="store_true")
    args = p.parse_args()
    for scale in map(float, args.logit_scales.split(",")):
        for bs in map(int, args.batch_sizes.split(",")):
            for name in args.presets.split(","):
                profile(bs, scale, name, args.vocab, args.kernels)


if __name__ == "__main__":
    main()
