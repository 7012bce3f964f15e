"""Timing for the GPU benchmark scripts in tools/ (imported by them, not by nanoqwen)."""

from __future__ import annotations

import torch


def graph_us(fn, reps: int = 20, iters: int = 30, capture_error_mode: str = "global") -> float:
    """GPU µs per call of fn, replayed from a CUDA graph that calls it reps times (no launch
    overhead), after a warm-up call and a warm-up replay. capture_error_mode "thread_local"
    where another thread queries events meanwhile (NCCL's watchdog)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
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
