"""The canonical quantized weight: what GGUF loading and quantize-on-load produce, and what
each device's kernels pack from.

A weight of logical shape [N, K] is stored as integer codes `q` [N, K] (uint8 0..15 for
bits=4, int8 -128..127 for bits=8), float32 `scale` [N, K // group_size] and an optional
float32 `offset` of the same shape, with

    w[n, k] = q[n, k] * scale[n, k // g] + (offset[n, k // g] if offset is not None else 0)

group_size == K is one scale per output row (per-channel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedWeight:
    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group_size: int
    bits: int

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.bits not in (4, 8):
            raise ValueError(f"bits={self.bits}: allowed 4 or 8")
        if k % self.group_size:
            raise ValueError(f"group_size={self.group_size} does not divide K={k}")
        want = torch.uint8 if self.bits == 4 else torch.int8
        if self.q.dtype != want:
            raise ValueError(f"bits={self.bits} codes must be {want}, got {self.q.dtype}")
        groups = (n, k // self.group_size)
        for name, t in (("scale", self.scale), ("offset", self.offset)):
            if t is not None and (tuple(t.shape) != groups or t.dtype != torch.float32):
                raise ValueError(f"{name} must be float32 {groups}, got {t.dtype} {tuple(t.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def per_channel(self) -> bool:
        return self.group_size == self.q.shape[1]

    def nbytes(self) -> int:
        """Bytes a kernel reads: codes at `bits` per value plus the group parameters."""
        params = self.scale.numel() * (1 if self.offset is None else 2)
        return self.q.numel() * self.bits // 8 + params * 2  # kernels keep bf16 scales

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight's rows `index` (an embedding lookup)."""
        offset = None if self.offset is None else self.offset[index]
        return QuantizedWeight(self.q[index], self.scale[index], offset, self.group_size, self.bits)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        offset = None if self.offset is None else self.offset.to(device)
        return QuantizedWeight(
            self.q.to(device), self.scale.to(device), offset, self.group_size, self.bits
        )


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stacks weights along N (the fused qkv and gate_up projections); all must share bits,
    group_size and whether they have an offset."""
    first = parts[0]
    for p in parts[1:]:
        same = (p.bits, p.group_size, p.offset is None, p.q.shape[1])
        if same != (first.bits, first.group_size, first.offset is None, first.q.shape[1]):
            raise ValueError("cannot fuse quantized weights of different layouts")
    offset = None if first.offset is None else torch.cat([p.offset for p in parts])
    return QuantizedWeight(
        torch.cat([p.q for p in parts]),
        torch.cat([p.scale for p in parts]),
        offset,
        first.group_size,
        first.bits,
    )


def dequantize(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] (computed in float32, then cast): the reference every kernel
    must match."""
    n, k = w.q.shape
    g = w.group_size
    values = w.q.to(torch.float32).view(n, k // g, g) * w.scale.unsqueeze(-1)
    if w.offset is not None:
        values = values + w.offset.unsqueeze(-1)
    return values.view(n, k).to(dtype)


def quantize_int8(
    w: torch.Tensor, group_size: int | None = None, float16_scales: bool = False
) -> QuantizedWeight:
    """Symmetric int8, one scale per group of `group_size` (None: per output channel); codes
    in -127..127 so that the scale is max|w| / 127 and zero is exact. float16_scales: scales
    rounded to float16, as GGUF's Q8_0 keeps them (group_size=32 is then Q8_0's form)."""
    n, k = w.shape
    g = k if group_size is None else group_size
    groups = w.detach().to(torch.float32).reshape(n, k // g, g)
    scale = groups.abs().amax(-1) / 127
    if float16_scales:
        scale = scale.half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(groups / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(q.view(n, k), scale.contiguous(), None, g, 8)


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Asymmetric int4: codes 0..15 spanning each group's [min, max]."""
    n, k = w.shape
    g = group_size
    groups = w.detach().to(torch.float32).reshape(n, k // g, g)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((groups - lo.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15)
    return QuantizedWeight(q.to(torch.uint8).view(n, k), scale.contiguous(), lo.contiguous(), g, 4)


def requantize_per_channel(w: QuantizedWeight, rows_at_once: int = 16384) -> QuantizedWeight:
    """quantize_int8(dequantize(w)) (one scale per output row), computed from the codes of a
    symmetric int8 weight in a few passes and a slice of rows at a time; other layouts go
    through the float weight."""
    if w.bits != 8 or w.offset is not None:
        return quantize_int8(dequantize(w))
    n, k = w.shape
    g = w.group_size
    codes, scales = [], []
    for start in range(0, n, rows_at_once):
        q = w.q[start : start + rows_at_once].view(-1, k // g, g)
        s = w.scale[start : start + rows_at_once]
        # max|q * s| per row is the groups' max|q| times their |s| (GGUF's s may be negative)
        row = (q.abs().amax(-1).float() * s.abs()).amax(-1) / 127
        factor = s / torch.where(row > 0, row, torch.ones_like(row)).unsqueeze(-1)
        x = q.float().mul_(factor.unsqueeze(-1))
        codes.append(x.round_().clamp_(-127, 127).to(torch.int8).view(-1, k))
        scales.append(row.unsqueeze(-1))
    return QuantizedWeight(torch.cat(codes), torch.cat(scales), None, k, 8)
