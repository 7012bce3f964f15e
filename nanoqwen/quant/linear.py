"""Weight-only quantized linear layers and the embedding lookup from quantized rows.

A QuantizedLinear holds its canonical QuantizedWeight until prepare() packs it for the
kernels of the device it lives on:

- CPU, few rows (decode): torch's packed kernels, which read the codes and dequantize inside
  the matmul: aten._weight_int4pack_mm_for_cpu (int4, groups of 32..256) and
  aten._weight_int8pack_mm (int8, one scale per output channel).
- CPU, many rows (prefill): those kernels are GEMV-shaped and slow past a few rows, while
  the bf16 matmul runs on AMX; so the weight is dequantized into the activation dtype and
  multiplied there. Its cost is spread over every row of the chunk.
- CUDA: nanoqwen.kernels.quant_matmul's Triton kernels (see cuda_pack/cuda_forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.quant.format import QuantizedWeight, dequantize

# Rows above which a CPU matmul dequantizes the weight and runs the dense matmul instead of
# the packed GEMV kernel (measured on the 0.5B model's shapes: see BENCHMARKS.md).
CPU_PACKED_MAX_ROWS = 4
_INT4_GROUPS = (32, 64, 128, 256)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [N, K] -> [N, K // 2], two codes a byte (even k in the low nibble)."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def _unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    return torch.stack((p & 0x0F, p >> 4), dim=-1).view(p.shape[0], -1)


class QuantizedLinear(nn.Module):
    """y = x @ W.T + bias for a QuantizedWeight W."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.group_size, self.bits = weight.group_size, weight.bits
        self.kind = "unprepared"
        self._packed: tuple = ()

    @property
    def device(self) -> torch.device:
        if self.weight is not None:
            return self.weight.q.device
        return self._packed[0].device

    def extra_repr(self) -> str:
        return (
            f"{self.in_features}->{self.out_features}, int{self.bits}, "
            f"group {self.group_size}, {self.kind}"
        )

    def prepare(self, dtype: torch.dtype) -> None:
        """Packs the weight for `dtype` activations on its device; the canonical codes are
        dropped where the packed form replaces them."""
        w = self.weight
        if self.bias is not None:
            self.bias = self.bias.to(dtype)
        if self.device.type == "cuda":
            self._packed, self.kind = (cuda_pack(w),), "triton"
            return
        scale = w.scale.to(dtype)
        offset = None if w.offset is None else w.offset.to(dtype)
        if w.bits == 4 and w.group_size in _INT4_GROUPS and self.out_features % 16 == 0:
            # tinygemm's convention: w = (q - 8) * scale + zero.
            zero = (w.offset if w.offset is not None else 0) + 8 * w.scale
            scales_zeros = torch.stack((w.scale, zero), dim=-1).transpose(0, 1).contiguous()
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 1)
            nibbles = _pack_nibbles(w.q)
            self._packed = (packed, scales_zeros.to(dtype), nibbles, scale, offset)
            self.kind = "int4pack"
        elif w.bits == 8 and w.per_channel and w.offset is None:
            self._packed = (w.q, scale.view(-1))
            self.kind = "int8pack"
        else:
            self._packed = (w.q, scale, offset)
            self.kind = "dequant"
        # The packed tensors replace the canonical codes (int8pack shares them).
        self.weight = None
        self.group_size, self.bits = w.group_size, w.bits

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a dense [N, K] tensor of dtype, from the packed form."""
        if self.kind == "int4pack":
            _, _, nibbles, scale, offset = self._packed
            q = _unpack_nibbles(nibbles)
        elif self.kind == "int8pack":
            q, scale = self._packed
            scale, offset = scale.view(-1, 1), None
        elif self.kind == "dequant":
            q, scale, offset = self._packed
        else:
            return dequantize(self.weight, dtype)
        n, k = q.shape
        groups = scale.shape[1]
        w = q.to(dtype).view(n, groups, k // groups) * scale.to(dtype).unsqueeze(-1)
        if offset is not None:
            w += offset.to(dtype).unsqueeze(-1)
        return w.view(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "triton":
            return cuda_forward(x, self._packed[0], self.bias)
        rows = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]
        if rows <= CPU_PACKED_MAX_ROWS:
            if self.kind == "int4pack":
                packed, scales_zeros, *_ = self._packed
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x.reshape(-1, self.in_features), packed, self.group_size, scales_zeros
                )
                y = y.view(*x.shape[:-1], self.out_features)
                return y if self.bias is None else y + self.bias
            if self.kind == "int8pack":
                q, scale = self._packed
                y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), q, scale)
                y = y.view(*x.shape[:-1], self.out_features)
                return y if self.bias is None else y + self.bias
        return F.linear(x, self.dequantized(x.dtype), self.bias)


class QuantizedEmbedding(nn.Module):
    """The token embedding as quantized rows; a lookup dequantizes only the rows it gathers.
    Indexing (`embedding[ids]`) is what Qwen2ForCausalLM.forward does with a plain tensor."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.dtype = dtype

    @property
    def device(self) -> torch.device:
        return self.weight.q.device

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.weight.shape)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.weight.rows(ids), self.dtype)


def cuda_pack(w: QuantizedWeight):
    """The GPU kernels' packed form (nanoqwen.kernels.quant_matmul, imported only here)."""
    from nanoqwen.kernels.quant_matmul import pack_for_triton

    return pack_for_triton(w.q, w.scale, w.offset, w.group_size, w.bits)


def cuda_forward(x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    from nanoqwen.kernels.quant_matmul import quant_linear

    return quant_linear(x, packed, bias)
