"""Weight-only quantized matrix-vector product for batch-1 decode.

At one token a projection is a pure weight stream, so the kernel reads each packed int32 word
once (a program holds `rows` output rows and walks K `words` words at a time) and spends as
few instructions per weight as it can, since at int4 the H200 delivers ~10 G weights per ms:
- a value becomes a float by OR-ing it into the mantissa of 2^23 and subtracting 2^23 (exact,
  and full-rate ALU work where an int-to-float conversion is quarter rate);
- the tile is [rows, groups, words per group], so a scale and an offset are loaded once per
  group and applied once per word: sum_k x_k (q_k s + o) = s sum_k x_k q_k + o sum_k x_k.
Accumulation is in float32; the result rounds once to x's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanoqwen.kernels.silu_mul import _silu_mul


@dataclass(frozen=True)
class GemvConfig:
    rows: int  # output rows per program
    words: int  # packed int32 words of each row per loop step (a power of two)
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _dequant_values(words, j: tl.constexpr, BITS: tl.constexpr):
    """Value j of every packed word as float32, minus the storage bias (128 for int8)."""
    MASK: tl.constexpr = (1 << BITS) - 1
    ZERO: tl.constexpr = 8388608.0 + (128.0 if BITS == 8 else 0.0)
    q = ((words >> (j * BITS)) & MASK) | 0x4B000000
    return q.to(tl.float32, bitcast=True) - ZERO


@triton.jit
def _row_dot(
    x_ptr, qw_ptr, s_ptr, o_ptr, rows, r_mask, KW, G,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr,
    BN: tl.constexpr, BG: tl.constexpr, WPG: tl.constexpr,
):  # fmt: skip
    """float32 dot products of x with the dequantized weight rows `rows`: [BN]."""
    VALS: tl.constexpr = 32 // BITS
    BW: tl.constexpr = BG * WPG
    rows64 = rows.to(tl.int64)
    b = tl.arange(0, BG)
    word = b[:, None] * WPG + tl.arange(0, WPG)[None, :]  # [BG, WPG] word within the step
    acc = tl.zeros([BN, BG, WPG], tl.float32)
    for k0 in range(0, KW, BW):
        col = k0 + word
        c_mask = col < KW
        mask = r_mask[:, None, None] & c_mask[None, :, :]
        words = tl.load(qw_ptr + rows64[:, None, None] * KW + col[None, :, :], mask=mask, other=0)
        # Group of each [BG] slice: its first value's column over the group size.
        grp = (k0 * VALS + b * (WPG * VALS)) // GROUP
        g_mask = r_mask[:, None] & (grp < G)[None, :]
        g_off = rows64[:, None] * G + grp[None, :]
        dot = tl.zeros([BN, BG, WPG], tl.float32)
        x_sum = tl.zeros([BG, WPG], tl.float32)
        for j in tl.static_range(VALS):
            xj = tl.load(x_ptr + col * VALS + j, mask=c_mask, other=0.0).to(tl.float32)
            dot += _dequant_values(words, j, BITS) * xj[None, :, :]
            if HAS_OFFSET:
                x_sum += xj
        scale = tl.load(s_ptr + g_off, mask=g_mask, other=0.0).to(tl.float32)
        acc += dot * scale[:, :, None]
        if HAS_OFFSET:
            offset = tl.load(o_ptr + g_off, mask=g_mask, other=0.0).to(tl.float32)
            acc += offset[:, :, None] * x_sum[None, :, :]
    return tl.sum(tl.sum(acc, 2), 1)


@triton.jit
def _qgemv_kernel(
    x_ptr, qw_ptr, s_ptr, o_ptr, b_ptr, y_ptr, N, KW, G,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr, WPG: tl.constexpr,
):  # fmt: skip
    """y = W x (+ b) for rows BN*pid..; with SILU_MUL, W holds gate rows then N up rows and
    y = silu(W_gate x) * (W_up x)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    r_mask = rows < N
    y = _row_dot(
        x_ptr, qw_ptr, s_ptr, o_ptr, rows, r_mask, KW, G,
        BITS, GROUP, HAS_OFFSET, BN, BG, WPG,
    )  # fmt: skip
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
    if SILU_MUL:
        up = _row_dot(
            x_ptr, qw_ptr, s_ptr, o_ptr, rows + N, r_mask, KW, G,
            BITS, GROUP, HAS_OFFSET, BN, BG, WPG,
        )  # fmt: skip
        # Both projections round to the model dtype first, as the unfused path's matmul does.
        y = _silu_mul(y.to(dtype), up.to(dtype), dtype)
    tl.store(y_ptr + rows, y.to(dtype), mask=r_mask)


def gemv_config(n: int, k: int, bits: int) -> GemvConfig:
    """Rows and words per program step from the shape alone (launch parameters never depend
    on data, so the kernel can be captured in CUDA graphs)."""
    kw = k * bits // 32
    words = 64
    while words > 8 and kw % words:
        words //= 2  # a step that divides the row wastes no masked loads
    rows = max(1, 512 // words)  # ~2-4 KB of weights per program step
    while rows > 2 and triton.cdiv(n, rows) < 512:
        rows //= 2  # enough programs to keep every SM streaming
    return GemvConfig(rows, words)


def launch_gemv(
    x: torch.Tensor, w, bias: torch.Tensor | None, silu_mul: bool, config: GemvConfig | None
) -> torch.Tensor:
    """x [1, K] times the packed weight: [1, N], or [1, N // 2] with silu_mul."""
    n = w.out_features // 2 if silu_mul else w.out_features
    cfg = config or gemv_config(w.out_features, w.in_features, w.bits)
    vals = 32 // w.bits
    wpg = min(w.group_size // vals, cfg.words) if w.group_size < w.in_features else cfg.words
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _qgemv_kernel[(triton.cdiv(n, cfg.rows),)](
        x.contiguous(), w.qweight, w.scales, w.scales if w.offsets is None else w.offsets,
        w.scales if bias is None else bias, y, n, w.qweight.shape[1], w.scales.shape[1],
        BITS=w.bits, GROUP=w.group_size, HAS_OFFSET=w.offsets is not None,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, BN=cfg.rows, BG=cfg.words // wpg, WPG=wpg,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y
