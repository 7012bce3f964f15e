"""Zeroed int32 counters on the device for kernels whose programs count themselves in with
an atomic add (the last to arrive finishes the work) and leave the count zero again.

Allocated, and zeroed, once per (device, user) and size, so a step's CUDA graph holds no
memset for them. Captured graphs hold a set's address, so a larger set never frees the one
before. Launches on one device run one after another, so one set serves each user.
"""

from __future__ import annotations

import torch

_MADE: dict[tuple[torch.device, str], list[torch.Tensor]] = {}


def zeroed_counters(device: torch.device, n: int, user: str) -> torch.Tensor:
    """At least n int32 counters, zero between the user's launches."""
    made = _MADE.setdefault((device, user), [])
    if not made or made[-1].numel() < n:
        made.append(torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device))
    return made[-1]
