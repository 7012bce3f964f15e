"""CUDA graph capture with Python's cyclic garbage collector paused.

A collection that starts inside a capture may free objects of an engine no longer in use,
its CUDA graphs among them; destroying a graph is not permitted while a stream captures, so
this capture would fail ("operation failed due to a previous error during capture"). Seen
when an earlier engine was kept alive by a reference cycle (a failed call's traceback)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def capture(graph: torch.cuda.CUDAGraph, pool=None, mode: str = "global") -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
            yield
    finally:
        if enabled:
            gc.enable()
