"""Counter-based sampling noise in torch, bit for bit the hash of kernels/triton/draw.py and
kernels/cpu/sample.c.

Token t of a request at output position n draws Gumbel noise from hash(seed, n, t), so a
request's draws depend on nothing else in the batch and need no generator state: a 64-bit
key per (seed, n) (splitmix64's finalizer), then a 32-bit hash of the key and t (lowbias32).
"""

from __future__ import annotations

import torch

_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_G1 = 0x9E3779B97F4A7C15
_G32 = 0x9E3779B9
_L1 = 0x7FEB352D
_L2 = 0x846CA68B
_LOW32 = 0xFFFFFFFF


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


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on uint32 values held in int64 (products wrap to their low 32 bits)."""
    x = x ^ (x >> 16)
    x = (x * _L1) & _LOW32
    x = x ^ (x >> 15)
    x = (x * _L2) & _LOW32
    return x ^ (x >> 16)


def gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 Gumbel(0, 1) noise for rows of (seed, output position)."""
    key = mix64(seeds + positions * _signed(_G1))
    key32 = (key ^ _shr(key, 32)) & _LOW32
    tokens = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device)
    bits = mix32((key32.unsqueeze(1) + tokens * _G32) & _LOW32)
    u = ((bits >> 9).float() + 0.5) * (1.0 / 8388608.0)
    return -torch.log(-torch.log(u))
