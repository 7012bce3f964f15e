"""Rotary position embedding (RoPE), as HF's Qwen2 applies it: non-interleaved halves
(rotate_half), cos/sin computed in float32. The model makes the tables; every attention
backend applies them to q and k (the GPU kernels fuse that with the KV write), so a scaled
RoPE (YaRN) is only other tables.

YaRN (https://arxiv.org/abs/2309.00071), as transformers computes it for Qwen2.5's
`rope_scaling: {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}`:
the frequencies that turn fewer than beta_slow times over the original context are divided by
factor (interpolated), those that turn more than beta_fast times are kept, a linear ramp
between; cos and sin are multiplied by the attention factor (0.1 ln(factor) + 1 unless
given)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @property
    def max_positions(self) -> int:
        """The context the scaled tables reach."""
        return int(self.original_max_position_embeddings * self.factor)

    def cos_sin_factor(self) -> float:
        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.factor, self.mscale) / get_mscale(
                self.factor, self.mscale_all_dim
            )
        return get_mscale(self.factor)

    def inv_freq(self, head_dim: int, base: float, device) -> torch.Tensor:
        def correction_dim(rotations: float) -> float:
            turns = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return head_dim * math.log(turns) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # no zero-width ramp
        ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)
        keep = (1 - ramp.clamp(0, 1)).to(device)  # 1: extrapolate (as trained), 0: interpolate
        pos_freqs = base ** (torch.arange(0, head_dim, 2).to(device, torch.float) / head_dim)
        extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
        return interpolated * (1 - keep) + extrapolated * keep


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE tables, computed once in float32 as HF computes them per step."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: float,
        device,
        yarn: YarnScaling | None = None,
    ) -> None:
        super().__init__()
        if yarn is None:
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
            inv_freq, scale = 1.0 / (base ** (exponents / head_dim)), 1.0
        else:
            inv_freq, scale = yarn.inv_freq(head_dim, base, device), yarn.cos_sin_factor()
        t = torch.arange(max_positions, dtype=torch.int64, device=device).float()
        freqs = torch.outer(t, inv_freq)
        # Half-width tables are what flash-attn and the Triton kernels read.
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.register_buffer("cos_half", cos, persistent=False)
        self.register_buffer("sin_half", sin, persistent=False)
        self.max_positions = max_positions

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        cos = self.cos_half[positions]
        sin = self.sin_half[positions]
        return torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] already in x's dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin
