"""Zeroed int32 counters on the device for kernels whose programs count themselves in with
an atomic add (the last to arrive finishes the work) and leave the count zero again.

Allocated, and zeroed, once per (device, user) and size, so a step's CUDA graph holds no
memset for them. Captured graphs hold a set's address, so a larger set never frees the one
before. Launches on one device run one after another, so one set serves each user.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MADE: dict[tuple[torch.device, str], list[torch.Tensor]] = {}


@triton.jit
def last_to_arrive(counter, total):
    """Counts this program in at counter (after every thread's stores: the barrier, then one
    thread's release); True in the last of `total` to arrive, which leaves the count zero and
    then sees every other program's stores (loads that skip L1)."""
    tl.debug_barrier()
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == total - 1
    tl.store(counter, 0, mask=last)  # ready for the next launch
    return last


def zeroed_counters(device: torch.device, n: int, user: str) -> torch.Tensor:
    """At least n int32 counters, zero between the user's launches."""
    made = _MADE.setdefault((device, user), [])
    if not made or made[-1].numel() < n:
        made.append(torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device))
    return made[-1]
