"""Weight-only quantized linear layers and the embedding lookup from quantized rows.

A QuantizedLinear holds its canonical QuantizedWeight until prepare() packs it for the
kernels of the device it lives on:

- CPU, few rows (decode): torch's packed kernels, which read the codes and dequantize inside
  the matmul: aten._weight_int4pack_mm_for_cpu (int4, groups of 32..256) and
  aten._weight_int8pack_mm (int8, one scale per output channel); GGUF Q5_0 and Q8_0 tensors,
  with bf16/fp16 activations, through nanoqwen.kernels.cpu.gguf's C kernels, which read the
  file's own blocks (Q5_0: 5.5 bits a weight, where the int8 kernel would need 8).
- CPU, many rows (prefill): those kernels are GEMV-shaped and slow past a few rows, and
  dequantizing the weight in torch costs more than the matmul. With bf16/fp16 activations
  the rows are quantized to int8 (one scale per row) and multiplied with per-channel int8
  codes of the weight in one int8 x int8 -> int32 matmul (oneDNN, AMX/VNNI), which beats
  even the bf16 AMX matmul. Without VNNI or AMX that matmul is slow, and GGUF blocks' rows go
  through their few-row kernels a few at a time instead. float32 activations are the exact
  mode: the weight is dequantized in float32, as the reference is.
- CUDA: nanoqwen.kernels.triton.quant_matmul's Triton kernels (see cuda_pack/cuda_forward).
"""

from __future__ import annotations

import contextlib
import contextvars
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.kernels.cpu.cpu_ops import cpu_kernels, dequantize_rows, quantize_rows_int8
from nanoqwen.kernels.cpu.gguf import fifth_bit_planes, gguf_kernel, gguf_matmul, max_rows
from nanoqwen.kernels.cpu.gguf_lanes import LANE_KINDS, from_lanes, to_lanes
from nanoqwen.quant.format import QuantizedWeight, dequantize, requantize_per_channel
from nanoqwen.quant.gguf_forms import (
    is_q5_0,
    is_q8_0,
    pack_q5_0,
    pack_q8_0,
    requantize_packed,
    requantize_rows,
)
from nanoqwen.quant.gguf_packed import PackedBlocks, PackedParts
from nanoqwen.quant.gguf_rows import GGUFRows

# Rows above which a CPU matmul leaves the packed GEMV kernel for the int8 x int8 matmul
# (crossover between 4 and 8 rows on the 0.5B model's shapes: see BENCHMARKS.md). The GGUF
# kernels read the file's blocks once for up to their max_rows (8 or 16) rows, which wins there
# for the lm_head, the step's largest weight: a speculative step's few rows stay with them.
CPU_PACKED_MAX_ROWS = 4
# Set while a step's rows must come out as decode steps would compute them, however many
# (a speculative verify step, whose rows are compared with what plain decoding samples):
# rows past the few-row kernels' limit then go through those kernels a few at a time, not
# through the int8 matmul over requantized codes, whose near-ties can fall the other way.
_DECODE_ARITHMETIC = contextvars.ContextVar("decode_arithmetic", default=False)


@contextlib.contextmanager
def decode_arithmetic():
    token = _DECODE_ARITHMETIC.set(True)
    try:
        yield
    finally:
        _DECODE_ARITHMETIC.reset(token)


@cache
def int8_matmul_is_fast() -> bool:
    """Whether torch's int8 x int8 matmul has VNNI or AMX under it on this CPU: on an AVX2 CPU
    it took a 0.5B model's prefill ~15x as long as the GGUF kernels a few rows at a time."""
    return torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported()


# What kernels.cpu.gguf.gguf_matmul reads.
GGUF_KINDS = ("q5_0", "q4_0", "q5_1", "q4_1", "q8_0", "q6_k", "q3_k", "q2_k", "q4_k", "q5_k")
_INT4_GROUPS = (32, 64, 128, 256)


class QuantizedLinear(nn.Module):
    """y = x @ W.T + bias for a QuantizedWeight W, or for GGUF blocks already in the CPU
    kernels' layouts (PackedBlocks, or a fused projection's PackedParts, which only bf16/fp16
    activations take)."""

    def __init__(
        self, weight: QuantizedWeight | PackedBlocks | PackedParts, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.weight: QuantizedWeight | PackedBlocks | PackedParts | None = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.group_size, self.bits = weight.group_size, weight.bits
        self.kind = "unprepared"
        self._decode: tuple = ()  # for PackedParts, its parts (PackedBlocks)
        self._parts = isinstance(weight, PackedParts)
        self._int8: tuple[torch.Tensor, torch.Tensor] | None = None
        self.dtype: torch.dtype | None = None  # the activations', from prepare()

    @property
    def device(self) -> torch.device:
        if isinstance(self.weight, (PackedBlocks, PackedParts)):
            return self.weight.device
        if self.weight is not None:
            return self.weight.q.device
        return self._decode[0].device

    @property
    def layout(self) -> str:
        """'int4 group 32 (q4_k)'; a PackedParts projection's kinds, which differ."""
        if self._parts:
            return f"parts ({self.kind})"
        return f"int{self.bits} group {self.group_size} ({self.kind})"

    @property
    def _file_blocks(self) -> bool:
        """Whether the layer runs GGUF blocks through kernels.cpu.gguf.gguf_matmul."""
        return self._parts or self.kind in GGUF_KINDS

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, {self.layout}"

    def prepare(self, dtype: torch.dtype, prefill_copy: bool = True) -> None:
        """Packs the weight for `dtype` activations on its device. float32 keeps the
        canonical weight (many-row matmuls dequantize it exactly); bf16/fp16 replace it
        with per-channel int8 codes for the int8 x int8 prefill matmul. prefill_copy=False:
        GGUF blocks make that copy when a call first has many rows (the lm_head, which
        computes logits for a few rows but for prompt logprobs)."""
        w = self.weight
        self.dtype = dtype
        if self.bias is not None:
            self.bias = self.bias.to(dtype)
        if isinstance(w, (PackedBlocks, PackedParts)):
            self._prepare_packed(w, dtype, prefill_copy)
            return
        if self.device.type == "cuda":
            self._decode, self.kind = (cuda_pack(w),), "triton"
            return
        exact8 = w if w.bits == 8 and w.per_channel and w.offset is None else None
        if w.bits == 4 and w.group_size in _INT4_GROUPS and self.out_features % 16 == 0:
            # tinygemm's convention: w = (q - 8) * scale + zero.
            zero = (w.offset if w.offset is not None else 0) + 8 * w.scale
            scales_zeros = torch.stack((w.scale, zero), dim=-1).transpose(0, 1).contiguous()
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 1)
            self._decode, self.kind = (packed, scales_zeros.to(dtype)), "int4pack"
        elif exact8 is not None:
            self._decode, self.kind = (w.q, w.scale.view(-1).to(dtype)), "int8pack"
        elif dtype != torch.float32 and is_q8_0(w) and gguf_kernel() is not None:
            q5 = is_q5_0(w)
            self.kind = "q5_0" if q5 else "q8_0"
            self._decode = _lanes(self.kind, pack_q5_0(w) if q5 else pack_q8_0(w))
        elif dtype == torch.float32:
            self.kind = "dequant"  # no kernel for this layout; float32 stays exact
        gguf = self.kind in ("q5_0", "q8_0")
        if dtype != torch.float32 and (not gguf or int8_matmul_is_fast()):
            # rounding far finer than any layout above (one scale per row, 255 levels)
            per_channel = exact8 or (requantize_rows(w) if gguf else requantize_per_channel(w))
            self._int8 = (per_channel.q, per_channel.scale.view(-1))
            if self.kind == "unprepared":
                self._decode, self.kind = (self._int8[0], self._int8[1].to(dtype)), "int8pack"
        if dtype != torch.float32:
            self.weight = None

    def _prepare_packed(
        self, w: PackedBlocks | PackedParts, dtype: torch.dtype, prefill_copy: bool
    ) -> None:
        """What prepare() makes of the canonical weight that w packs: the same kernels and
        the same per-channel int8 copy, without unpacking the codes (per-channel: a
        PackedParts projection's copy is its parts' copies stacked)."""
        if dtype == torch.float32 or w.device.type != "cpu" or gguf_kernel() is None:
            raise ValueError(
                f"PackedBlocks need the CPU's GGUF kernels and bf16/fp16 activations "
                f"(got {dtype} on {w.device})"
            )
        self.kind = w.kind
        if prefill_copy and int8_matmul_is_fast():
            self._int8 = self._packed_int8(w.parts if self._parts else [w])
        lanes = [PackedBlocks(p.kind, _lanes(p.kind, p.tensors)) for p in self._file_parts(w)]
        self._decode = tuple(lanes) if self._parts else lanes[0].tensors
        self.weight = None

    def _file_parts(self, w: PackedBlocks | PackedParts | None = None) -> list[PackedBlocks]:
        """w's parts (PackedParts) or w; by default the layer's, as the file has their arrays."""
        if w is not None:
            return list(w.parts) if self._parts else [w]
        parts = self._decode if self._parts else [PackedBlocks(self.kind, self._decode)]
        return [PackedBlocks(p.kind, _unlanes(p.kind, p.tensors)) for p in parts]

    def _packed_int8(
        self, parts: list[PackedBlocks] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The GGUF blocks' per-channel int8 copy (a PackedParts projection's: its parts'
        copies stacked, since the copy is per row), from the file's arrays: parts, or the
        layer's own."""
        parts = parts or self._file_parts()
        copies = [requantize_packed(p.kind, p.tensors) for p in parts]
        q = copies[0].q if len(copies) == 1 else torch.cat([c.q for c in copies])
        scale = copies[0].scale if len(copies) == 1 else torch.cat([c.scale for c in copies])
        return q, scale.view(-1)

    def decode_bytes(self) -> int:
        """Bytes the few-rows kernel reads per call."""
        tensors = [t for p in self._decode for t in p.tensors] if self._parts else self._decode
        if self.kind == "triton":  # whatever tensors the packed object holds
            packed = self._decode[0]
            found = packed if isinstance(packed, (tuple, list)) else vars(packed).values()
            tensors = [t for t in found if isinstance(t, torch.Tensor)]
        total = sum(t.numel() * t.element_size() for t in tensors)
        return total + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    @property
    def takes_squares(self) -> bool:
        """Whether one row can run add_row and normed_row (the tensor-core int4 GEMV)."""
        if self.kind != "triton":
            return False
        from nanoqwen.kernels.triton.quant_gemv_mma import mma_fits

        return mma_fits(self._decode[0], self.dtype, self.device)

    # add_row also weighs the stream by the norm behind (model/summed_row.py)
    takes_weighted = True

    def add_row(
        self, x: torch.Tensor, residual: torch.Tensor, norm_after=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(residual + self(x), the float32 partial sums of its squares, and where a norm
        follows the stream times its weight, rounded) for one row."""
        from nanoqwen.kernels.triton.quant_matmul import quant_linear_add

        weight = None if norm_after is None else norm_after.weight
        return quant_linear_add(x, self._decode[0], self.bias, residual, weight)

    def normed_row(self, stream, squares, norm, silu_mul: bool = False, weighted=None):
        """self(norm(stream)), or SiLU·up of it, for one row whose squares (and weighted
        stream) add_row made: the norm's 1 / RMS multiplies the product's sums."""
        from nanoqwen.kernels.triton.quant_matmul import quant_linear_normed

        if weighted is None:
            weighted = (stream * norm.weight).to(stream.dtype)
        return quant_linear_normed(weighted, self._decode[0], self.bias, squares, norm.eps,
                                   silu_mul)  # fmt: skip

    @property
    def fuses_silu_mul(self) -> bool:
        """Whether silu_mul_row runs (MLP asks, for a single row of its fused gate_up)."""
        return self.kind == "triton"

    def silu_mul_row(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a fused gate_up weight for one row of x, in one kernel (CUDA)."""
        from nanoqwen.kernels.triton.quant_matmul import quant_linear_silu_mul

        return quant_linear_silu_mul(x, self._decode[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "triton":
            return cuda_forward(x, self._decode[0], self.bias)
        shape = (*x.shape[:-1], self.out_features)
        x2 = x.reshape(-1, self.in_features)
        few = self._gguf_max_rows() if self._file_blocks else CPU_PACKED_MAX_ROWS
        prepared = self.kind not in ("dequant", "unprepared")
        few_at_a_time = _DECODE_ARITHMETIC.get() or (
            self._file_blocks and not int8_matmul_is_fast()
        )
        if x2.shape[0] > few and prepared and few_at_a_time:
            return torch.cat([self.forward(rows) for rows in x2.split(few)]).view(shape)
        if x2.shape[0] > few or not prepared:
            if self._int8 is None and self._file_blocks:
                self._int8 = self._packed_int8()  # prepare()'s prefill_copy=False
            if self._int8 is None or x.dtype == torch.float32:
                return F.linear(x, dequantize(self.weight, x.dtype), self.bias)
            if x.dtype == torch.bfloat16 and cpu_kernels() is not None:
                return _int8_matmul_native(x2, *self._int8, self.bias).view(shape)
            y = _int8_matmul(x2, *self._int8)
        elif self._file_blocks and x.dtype == torch.bfloat16:
            return self._gguf_matmul(x2.contiguous(), self.bias).view(shape)
        elif self._file_blocks:
            y = self._gguf_matmul(x2.contiguous(), None).to(x.dtype)
        elif self.kind == "int4pack":
            packed, scales_zeros = self._decode
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, packed, self.group_size, scales_zeros
            )
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, *self._decode)
        y = y.view(shape)
        return y if self.bias is None else y + self.bias

    def _gguf_max_rows(self) -> int:
        """The most rows one pass of the GGUF kernels takes (of every part's)."""
        return min(max_rows(p.kind) for p in self._decode) if self._parts else max_rows(self.kind)

    def _gguf_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """kernels.cpu.gguf.gguf_matmul, of each part for PackedParts (with its slice of the bias),
        their outputs side by side."""
        if not self._parts:
            return gguf_matmul(x, self.kind, self._decode, bias)
        outs, start = [], 0
        for p in self._decode:
            end = start + p.shape[0]
            part_bias = None if bias is None else bias[start:end]
            outs.append(gguf_matmul(x, p.kind, p.tensors, part_bias))
            start = end
        return torch.cat(outs, dim=-1)


def _lanes(kind: str, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A GGUF kind's file arrays in the few-row kernel's layout (gguf_lanes)."""
    return to_lanes(kind, tensors, planes=fifth_bit_planes()) if kind in LANE_KINDS else tensors


def _unlanes(kind: str, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return from_lanes(kind, tensors, planes=fifth_bit_planes()) if kind in LANE_KINDS else tensors


def _int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (q * scale).T with x quantized per row to int8 (as llama.cpp quantizes activations
    to Q8 blocks): one int8 x int8 -> int32 matmul (AMX/VNNI through oneDNN)."""
    xf = x.float()
    x_scale = xf.abs().amax(-1, keepdim=True).clamp_(min=1e-30) / 127
    xq = torch.round(xf / x_scale).to(torch.int8)
    y = torch._int_mm(xq, q.t()).float()
    return (y * x_scale * scale).to(x.dtype)


def _int8_matmul_native(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """_int8_matmul(x, q, scale) (+ bias) for bf16 x, bit for bit, its elementwise passes in C
    (the activations' quantization, the sums' scaling, cast and bias): in torch's ops they
    took ~40% of a 512-token prefill of the default model."""
    xq, x_scale = quantize_rows_int8(x)
    return dequantize_rows(torch._int_mm(xq, q.t()), x_scale, scale, bias)


class QuantizedEmbedding(nn.Module):
    """The token embedding as quantized rows; a lookup dequantizes only the rows it gathers
    (and, for GGUFRows, decodes only those from the file's blocks). Indexing
    (`embedding[ids]`) is what Qwen2ForCausalLM.forward does with a plain tensor."""

    def __init__(self, weight: QuantizedWeight | GGUFRows, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.dtype = dtype

    @property
    def device(self) -> torch.device:
        if isinstance(self.weight, GGUFRows):
            return self.weight.device
        return self.weight.q.device

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.weight.shape)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.weight.rows(ids), self.dtype)


def cuda_pack(w: QuantizedWeight):
    """The GPU kernels' packed form (nanoqwen.kernels.triton.quant_matmul, imported only here)."""
    from nanoqwen.kernels.triton.quant_matmul import pack_for_triton

    return pack_for_triton(w.q, w.scale, w.offset, w.group_size, w.bits)


def cuda_forward(x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    from nanoqwen.kernels.triton.quant_matmul import quant_linear

    return quant_linear(x, packed, bias)
