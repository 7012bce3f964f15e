"""The building blocks of a Qwen2 decoder layer, written to match HF's numerics."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Weights always come from a checkpoint or an explicit random fill, so skip init work.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """With gemv=True (small weights, bf16/fp16 on CUDA) a single row goes through the
    Triton GEMV, bias included."""

    gemv = False

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv and x.shape[0] == 1:
            from nanoqwen.kernels.triton.gemv import gemv

            return gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm that can also absorb the residual add in front of it.

    With fused=True (set for bf16/fp16 on CUDA) one Triton kernel does add + norm; with
    native=True (bf16 on the CPU) one C call, with HF's roundings; otherwise plain torch ops
    in HF's exact order.
    """

    fused = False
    native = False

    def __init__(self, size: int, eps: float, dtype, device) -> None:
        super().__init__()
        self.weight = _empty(size, dtype=dtype, device=device)
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # HF normalizes in float32 and casts back before the weight multiply.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); residual=None means x alone."""
        if self.fused:
            from nanoqwen.kernels.triton.rms_norm import rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps), x
            return rms_norm(x, self.weight, self.eps, residual), residual
        if self.native:
            from nanoqwen.kernels.cpu.cpu_ops import add_rms_norm

            return add_rms_norm(x, self.weight, self.eps, residual)
        residual = x if residual is None else residual + x
        return self._norm(residual), residual


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


class MLP(nn.Module):
    fused = False  # Triton SiLU·up kernel
    native = False  # C SiLU·up (bf16 on the CPU)
    gemv = False  # a single row: gate_up GEMV with SiLU·up in its epilogue

    def __init__(self, hidden: int, intermediate: int, dtype, device) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, False, dtype, device)
        self.down_proj = Linear(intermediate, hidden, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv and x.shape[0] == 1:
            from nanoqwen.kernels.triton.gemv import gemv_silu_mul

            return self.down_proj(gemv_silu_mul(x, self.gate_up_proj.weight))
        if x.shape[0] == 1 and getattr(self.gate_up_proj, "fuses_silu_mul", False):
            # a quantized gate_up's GEMV with SiLU·up in its epilogue
            return self.down_proj(self.gate_up_proj.silu_mul_row(x))
        gate_up = self.gate_up_proj(x)
        if self.fused:
            from nanoqwen.kernels.triton.silu_mul import silu_mul

            return self.down_proj(silu_mul(gate_up))
        if self.native:
            from nanoqwen.kernels.cpu.cpu_ops import silu_mul as native_silu_mul

            return self.down_proj(native_silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
