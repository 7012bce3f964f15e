"""Large zeroed host tensors that cost nothing until they are used."""

from __future__ import annotations

import math
import mmap

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros, but on the CPU from a private anonymous memory map: the OS zero-fills
    its pages on first touch, so a tensor of gigabytes costs nothing until it is used,
    where torch.zeros writes every byte first (~1.3 s of a CPU `nanoqwen generate`'s start
    for the default 1 GiB KV pool). Not numpy's zeros (calloc), which did the same but whose
    pages took ~20x longer to touch first on the 2-core CI machine (24 x 64 KB: 7 against
    0.4 ms): ~250 of the ~320 ms of the default model's first request."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    # Page-aligned; the tensor keeps the map alive (torch.frombuffer holds a reference).
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)
