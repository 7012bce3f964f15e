"""Weight-only int4/int8 linear layers on the GPU: pack once at load, multiply every step.

The canonical weight is w[n, k] = q[n, k] * scale[n, k // g] + offset[n, k // g] (offset
optional), with q in 0..15 (bits=4) or -128..127 (bits=8). `pack_for_triton` turns it into
the layout the kernels read: each row's values packed into int32 words (eight int4, or four
int8 biased by +128, value j in bits j*bits..) by panels of PANEL words, where value j of
word i holds column j * PANEL + i of the panel (so the GEMV loads x for value j of every word
as one contiguous vector), and the group scales and offsets as [N, K // g] float32 matrices
(float16 on request, where exact). `quant_linear` picks the
kernel from the number of rows alone (so a CUDA graph can capture it): one row, the GEMV of
kernels/triton/quant_gemv_mma.py (int4 in groups of 128 or more) or
kernels/triton/quant_gemv.py; up to DEQUANT_MIN_M rows, the tensor-core GEMM of
kernels/triton/quant_gemm.py; more (prefill), dequantize to x's dtype and let cuBLAS multiply.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from nanoqwen.kernels.triton.quant_gemm import GemmConfig, dequantize, launch_gemm
from nanoqwen.kernels.triton.quant_gemv import PANEL, GemvConfig, launch_gemv
from nanoqwen.kernels.triton.quant_gemv_mma import MmaGemvConfig, launch_mma_gemv, mma_gemv_fits

DEQUANT_MIN_M = 512  # from here a dense dequantized matrix and cuBLAS beat the Triton GEMM


@dataclass
class PackedWeight:
    """The device tensors of one quantized [out_features, in_features] weight."""

    qweight: torch.Tensor  # int32 [N, K * bits // 32 rounded up to whole panels]
    scales: torch.Tensor  # float16 or float32 [N, K // group_size]
    offsets: torch.Tensor | None  # like scales, or None (symmetric)
    bits: int
    group_size: int
    out_features: int
    in_features: int

    def to(self, device: torch.device | str) -> PackedWeight:
        """The same weight on device (pack on the CPU at load, then move)."""
        move = {"qweight": self.qweight, "scales": self.scales, "offsets": self.offsets}
        return replace(self, **{k: None if t is None else t.to(device) for k, t in move.items()})

    @property
    def nbytes(self) -> int:
        """Bytes a full pass over the weight reads."""
        parts = (self.qweight, self.scales, self.offsets)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def _check_groups(name: str, t: torch.Tensor, shape: tuple[int, int]) -> None:
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)} (N, K // group_size), got "
                         f"{list(t.shape)}")  # fmt: skip
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} holds non-finite values")


def _pack_values(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K] values -> int32 words [N, ceil(K / panel) * PANEL], zero-padded on the right."""
    vals = 32 // bits
    n, k = q.shape
    panel = PANEL * vals  # columns per panel
    u = q.to(torch.int64) + (128 if bits == 8 else 0)  # int8 is stored biased, as 0..255
    u = F.pad(u, (0, -k % panel), value=128 if bits == 8 else 0)
    # Column p * panel + j * PANEL + i is value j of word i of panel p.
    u = u.view(n, -1, vals, PANEL).transpose(2, 3)
    shifts = torch.arange(vals, device=q.device, dtype=torch.int64) * bits
    words = (u << shifts).sum(-1).view(n, -1)  # disjoint bits: sum == OR
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # as two's complement
    return words.to(torch.int32).contiguous()


def _compact(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.to(dtype).contiguous()


def pack_for_triton(
    q: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group_size: int,
    bits: int,
    scale_dtype: torch.dtype = torch.float32,
) -> PackedWeight:
    """Validate and pack a quantized weight for quant_linear (on q's device).

    scale_dtype=torch.float16 stores scales and offsets in half the bytes, where every value
    survives the round trip exactly. Measure it first (q4g128h in tools/quant_kernel_bench.py):
    a program's float16 scales are 2 bytes a thread, too narrow for cp.async, so the GEMV
    loads them outside its software pipeline."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    want = torch.uint8 if bits == 4 else torch.int8
    if q.dtype != want:
        raise TypeError(f"q must be {want} for bits={bits}, got {q.dtype}")
    if q.dim() != 2:
        raise ValueError(f"q must be 2-D [N, K], got shape {list(q.shape)}")
    n, k = q.shape
    if not isinstance(group_size, int) or group_size <= 0 or k % group_size:
        raise ValueError(f"group_size must divide K={k}, got {group_size}")
    if group_size != k and (group_size < 16 or group_size & (group_size - 1)):
        raise ValueError(
            f"group_size must be a power of two >= 16 or K={k} (per channel), got {group_size}"
        )
    if bits == 4 and int(q.max()) > 15:
        raise ValueError(f"q holds {int(q.max())}, outside 0..15 for bits=4")
    shape = (n, k // group_size)
    _check_groups("scale", scale, shape)
    if offset is not None:
        _check_groups("offset", offset, shape)
    devices = {t.device for t in (q, scale, offset) if t is not None}
    if len(devices) > 1:
        raise ValueError(
            f"q, scale and offset must share a device, got {sorted(map(str, devices))}"
        )
    if scale_dtype not in (torch.float32, torch.float16):
        raise ValueError(f"scale_dtype must be torch.float32 or torch.float16, got {scale_dtype}")
    if scale_dtype == torch.float16 and not all(
        torch.equal(t.half().float(), t) for t in (scale, offset) if t is not None
    ):
        raise ValueError("scale_dtype=torch.float16 needs scales and offsets exact in float16")
    return PackedWeight(
        qweight=_pack_values(q, bits),
        scales=_compact(scale, scale_dtype),
        offsets=_compact(offset, scale_dtype),
        bits=bits,
        group_size=group_size,
        out_features=n,
        in_features=k,
    )


def _check_input(x: torch.Tensor, w: PackedWeight) -> None:
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be [M, {w.in_features}], got {list(x.shape)}")


def _gemv(x, w, bias, silu_mul: bool, config) -> torch.Tensor:
    """The tensor-core GEMV where it applies (or is asked for), else the CUDA-core one."""
    if isinstance(config, MmaGemvConfig) or (config is None and mma_gemv_fits(x, w)):
        return launch_mma_gemv(x, w, bias, silu_mul, config)
    return launch_gemv(x, w, bias, silu_mul, config)


def quant_linear(
    x: torch.Tensor,
    w: PackedWeight,
    bias: torch.Tensor | None = None,
    config: GemvConfig | MmaGemvConfig | GemmConfig | None = None,
) -> torch.Tensor:
    """F.linear(x, dequantized w, bias): [M, K] -> [M, N] in x's dtype, float32 accumulation.

    config overrides the shape-based launch parameters (tools/quant_kernel_bench.py)."""
    _check_input(x, w)
    m = x.shape[0]
    if m == 1 and not isinstance(config, GemmConfig):
        return _gemv(x, w, bias, False, config)
    if m >= DEQUANT_MIN_M and config is None:
        return F.linear(x, dequantize(w, x.dtype), bias)
    return launch_gemm(x, w, bias, config)


def quant_linear_silu_mul(
    x: torch.Tensor, w: PackedWeight, config: GemvConfig | MmaGemvConfig | None = None
) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) for the MLP's fused gate_up weight [W_gate; W_up]:
    [M, K] -> [M, N // 2]. One kernel for a single row; more rows run quant_linear first."""
    _check_input(x, w)
    if x.shape[0] == 1:
        return _gemv(x, w, None, True, config)
    from nanoqwen.kernels.triton.silu_mul import silu_mul

    return silu_mul(quant_linear(x, w))


def quant_linear_add(
    x: torch.Tensor,
    w: PackedWeight,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_after: torch.Tensor | None = None,
    config: MmaGemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One row's (residual + quant_linear(x, w, bias), float32 partial sums of its squares,
    that times norm_after rounded, or None without it) in one launch, on the tensor-core
    GEMV (where quant_gemv_mma.mma_fits)."""
    _check_input(x, w)
    return launch_mma_gemv(x, w, bias, False, config, residual=residual, norm_after=norm_after)


def quant_linear_normed(
    weighted: torch.Tensor,
    w: PackedWeight,
    bias: torch.Tensor | None,
    squares: torch.Tensor,
    eps: float,
    silu_mul: bool = False,
    config: MmaGemvConfig | None = None,
) -> torch.Tensor:
    """quant_linear (or quant_linear_silu_mul) of one row's RMSNorm for the row's squares
    and weighted (quant_linear_add's): the norm's 1 / RMS multiplies the product's sums."""
    _check_input(weighted, w)
    return launch_mma_gemv(weighted, w, bias, silu_mul, config, squares=squares, eps=eps)
