"""The building blocks of a Qwen2 decoder layer, written to match HF's numerics."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.kernels.layer_ops import TORCH_OPS


def _empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Weights always come from a checkpoint or an explicit random fill, so skip init work.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """With gemv=True (set by Qwen2ForCausalLM.set_ops where the ops' GEMV pays for this
    weight) a single row goes through ops.gemv, bias included."""

    ops = TORCH_OPS
    gemv = False

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv and x.shape[0] == 1:
            return self.ops.gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    @property
    def takes_squares(self) -> bool:
        """Whether one row can run add_row and normed_row (ops.streams takes the weight)."""
        return self.gemv and self.ops.gemv_add is not None and self.ops.streams(self.weight)

    def add_row(
        self, x: torch.Tensor, residual: torch.Tensor, norm_after=None
    ) -> tuple[torch.Tensor, ...]:
        """(residual + self(x), the float32 partial sums of its squares) for one row
        (norm_after, the norm behind: the product after it normalizes for itself)."""
        return self.ops.gemv_add(x, self.weight, self.bias, residual)

    def normed_row(self, stream, squares, norm, silu_mul: bool = False, weighted=None):
        """self(norm(stream)), or SiLU·up of it, for one row whose squares add_row summed."""
        return self.ops.squares_norm_gemv(stream, squares, norm.weight, norm.eps, self.weight,
                                          self.bias, silu_mul)  # fmt: skip


class RMSNorm(nn.Module):
    """RMSNorm that can also absorb the residual add in front of it: ops.add_rms_norm (one
    Triton kernel or one C call) where the device has one, else plain torch ops in HF's
    exact order."""

    ops = TORCH_OPS

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
        if self.ops.add_rms_norm is not None:
            return self.ops.add_rms_norm(x, self.weight, self.eps, residual)
        residual = x if residual is None else residual + x
        return self._norm(residual), residual


class MLP(nn.Module):
    ops = TORCH_OPS
    gemv = False  # a single row: ops.gemv_silu_mul, SiLU·up in the GEMV's epilogue

    def __init__(self, hidden: int, intermediate: int, dtype, device) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, False, dtype, device)
        self.down_proj = Linear(intermediate, hidden, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv and x.shape[0] == 1:
            return self.down_proj(self.ops.gemv_silu_mul(x, self.gate_up_proj.weight))
        if x.shape[0] == 1 and getattr(self.gate_up_proj, "fuses_silu_mul", False):
            # a quantized gate_up's GEMV with SiLU·up in its epilogue
            return self.down_proj(self.gate_up_proj.silu_mul_row(x))
        gate_up = self.gate_up_proj(x)
        if self.ops.silu_mul is not None:
            return self.down_proj(self.ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
