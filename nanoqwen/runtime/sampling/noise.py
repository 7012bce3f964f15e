"""Counter-based sampling noise in torch, bit for bit the hash of kernels/triton/sample.py.

Token t of a request at output position n draws Gumbel noise from hash(seed, n, t), so a
request's draws depend on nothing else in the batch and need no generator state.
"""

from __future__ import annotations

import torch

_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_G1 = 0x9E3779B97F4A7C15
_G2 = 0xD1B54A32D192ED03


def _signed(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 bits (multiplication wraps as uint64 does)."""
    x = x ^ _shr(x, 30)
    x = x * _signed(_M1)
    x = x ^ _shr(x, 27)
    x = x * _signed(_M2)
    return x ^ _shr(x, 31)


def gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 Gumbel(0, 1) noise for rows of (seed, output position)."""
    key = mix64(seeds + positions * _signed(_G1))
    tokens = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device)
    bits = mix64(key.unsqueeze(1) + tokens * _signed(_G2))
    u = (_shr(bits, 41).float() + 0.5) * (1.0 / 8388608.0)
    return -torch.log(-torch.log(u))
