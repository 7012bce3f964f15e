"""Rotary position embedding (RoPE), as HF's Qwen2 applies it: non-interleaved halves
(rotate_half), cos/sin computed in float32. The model makes the tables; every attention
backend applies them to q and k (the GPU kernels fuse that with the KV write)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE tables, computed once in float32 as HF computes them per step."""

    def __init__(self, head_dim: int, max_positions: int, base: float, device) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq = 1.0 / (base ** (exponents / head_dim))
        t = torch.arange(max_positions, dtype=torch.int64, device=device).float()
        freqs = torch.outer(t, inv_freq)
        # Half-width tables are what flash-attn and the Triton kernels read.
        self.register_buffer("cos_half", freqs.cos(), persistent=False)
        self.register_buffer("sin_half", freqs.sin(), persistent=False)
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
