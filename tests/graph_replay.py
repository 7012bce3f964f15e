"""A GPU test helper: a function of some input buffers, captured in a CUDA graph, replays
what it computes eagerly, bit for bit, with new inputs copied into the captured buffers."""

from __future__ import annotations

import torch


def assert_replays_eager(step, *inputs: torch.Tensor, rounds: int = 3) -> None:
    """step(*inputs) -> a tuple of tensors; inputs are refilled with random values before
    each replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(*inputs)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(*inputs)
    for seed in range(rounds):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for t in inputs:
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda"))
        graph.replay()
        for got, want in zip(outs, step(*inputs), strict=True):
            assert torch.equal(got, want)
