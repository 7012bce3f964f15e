"""StepBuffer: a step's inputs in one int64 buffer, the one form in which they reach the
device: eager steps, the decode and prefill CUDA graphs, and the tensor-parallel broadcast
all read it.

A layout names the fields: int64 ones first, then int32 ones packed two to an entry. The host
fills numpy views of a pinned mirror; one asynchronous copy sends the buffer to the device,
where tensor views of the same layout are what the model reads (and, under tensor
parallelism, what rank 0 broadcasts to the others). Filling and sending cost no allocation
and no launch per field."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from types import SimpleNamespace

import numpy as np
import torch


@dataclass(frozen=True)
class Layout:
    """Field name -> shape, int64 fields then int32 fields, in buffer order."""

    int64: tuple[tuple[str, tuple[int, ...]], ...]
    int32: tuple[tuple[str, tuple[int, ...]], ...]

    @staticmethod
    def of(int64: dict[str, tuple[int, ...] | int], int32: dict[str, tuple[int, ...] | int]):
        def shapes(fields):
            return tuple((k, v if isinstance(v, tuple) else (v,)) for k, v in fields.items())

        return Layout(shapes(int64), shapes(int32))

    # Computed once a layout: every step reads them (math.prod, not numpy's, which costs
    # microseconds a field).
    @cached_property
    def spans(self) -> tuple[tuple[bool, str, int, int, tuple[int, ...]], ...]:
        """(is int32, name, start, size, shape) of each field, in its part of the buffer."""
        spans = []
        for is32, spec in ((False, self.int64), (True, self.int32)):
            at = 0
            for name, shape in spec:
                size = math.prod(shape)
                spans.append((is32, name, at, size, shape))
                at += size
        return tuple(spans)

    @cached_property
    def int64_entries(self) -> int:
        return sum(size for is32, _, _, size, _ in self.spans if not is32)

    @cached_property
    def int32_entries(self) -> int:
        return sum(size for is32, _, _, size, _ in self.spans if is32)

    @cached_property
    def entries(self) -> int:
        """The buffer's size in int64 entries."""
        return self.int64_entries + -(-self.int32_entries // 2)

    def views(self, buffer):
        """The fields as views of buffer (a tensor, or a numpy array on the host)."""
        split = self.int64_entries
        if isinstance(buffer, np.ndarray):
            part32 = buffer[split:].view(np.int32)
        else:
            part32 = buffer[split:].view(torch.int32)
        return SimpleNamespace(**{
            name: (part32 if is32 else buffer)[at : at + size].reshape(shape)
            for is32, name, at, size, shape in self.spans
        })  # fmt: skip


class StepBuffer:
    """The device buffer of a layout, its pinned host mirrors and the fields of both.

    With two mirrors (the graphs') they take turns: step N's copy may still be queued behind
    step N-1 while step N+1 fills the other. An eager step's buffer is made for that step
    alone (one mirror)."""

    def __init__(self, layout: Layout, device: torch.device, mirrors: int = 2) -> None:
        self.layout = layout
        pin = device.type == "cuda"
        self.mirrors = [
            torch.zeros(layout.entries, dtype=torch.int64, pin_memory=pin) for _ in range(mirrors)
        ]
        self.host_fields = [layout.views(m.numpy()) for m in self.mirrors]
        self.turn = 0
        if device.type == "cpu":  # the host mirror is what the step reads
            self.dev = self.mirrors[0] if mirrors == 1 else self.mirrors[0].clone()
        else:
            self.dev = torch.empty(layout.entries, dtype=torch.int64, device=device)
        self.fields = layout.views(self.dev)

    def host(self) -> SimpleNamespace:
        """The fields of the mirror to fill for the next send()."""
        return self.host_fields[self.turn]

    def send(self, entries: int | None = None) -> None:
        """Copies the first entries (all by default) of the filled mirror to the device
        buffer, asynchronously; the next host() is the other mirror."""
        mirror = self.mirrors[self.turn]
        self.turn = (self.turn + 1) % len(self.mirrors)
        if mirror is self.dev:
            return
        n = self.layout.entries if entries is None else entries
        self.dev[:n].copy_(mirror[:n], non_blocking=True)
