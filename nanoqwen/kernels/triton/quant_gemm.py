"""Weight-only quantized matrix products for more than one row, on the tensor cores.

A program steps through K one panel at a time (PANEL packed words a row: 128 int4 or 64 int8
columns, kernels/triton/quant_matmul.py): it dequantizes the panel for its BN rows into x's dtype
in registers, value slot j of the words giving columns j * PANEL.., so a reshape lines them up
with a [BM, panel] tile of x for tl.dot; the weight is read from HBM packed, each word once.
Decode batches are a handful of rows and a projection has few BN-column tiles, so a small
grid splits K as well (`split_k`): each split writes float32 partial sums and one reduction
adds them in a fixed order (deterministic, no atomics). Large M (prefill) can instead
dequantize the whole matrix once (`dequantize`) and leave the product to cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanoqwen.kernels.triton.quant_gemv import PANEL, kernel_group, sm_count


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _dequant_values(words, shift, BITS: tl.constexpr):
    """The value at bit `shift` of packed words as float32, less the storage bias (128 for
    int8)."""
    MASK: tl.constexpr = (1 << BITS) - 1
    ZERO: tl.constexpr = 8388608.0 + (128.0 if BITS == 8 else 0.0)
    q = ((words >> shift) & MASK) | 0x4B000000
    return q.to(tl.float32, bitcast=True) - ZERO


@triton.jit
def _dequant_panel(qw_ptr, s_ptr, o_ptr, n64, n_mask, panel, KW, G,
                   BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr):  # fmt: skip
    """float32 weights of one panel for rows n64 [BN]: [PANEL * VALS, BN], row r holding the
    panel's column r."""
    VALS: tl.constexpr = 32 // BITS
    P: tl.constexpr = 16  # PANEL
    lane = tl.arange(0, P)
    words = tl.load(
        qw_ptr + n64[None, :] * KW + (panel * P + lane)[:, None], mask=n_mask[None, :], other=0
    )
    j = tl.arange(0, VALS)
    w = _dequant_values(words[None, :, :], (j * BITS)[:, None, None], BITS)  # [VALS, P, BN]
    grp = (panel * (P * VALS) + j * P) // GROUP
    g_off = n64[None, None, :] * G + grp[:, None, None]
    g_mask = n_mask[None, None, :] & (grp < G)[:, None, None]
    scale = tl.load(s_ptr + g_off, mask=g_mask, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        w = tl.fma(w, scale, tl.load(o_ptr + g_off, mask=g_mask, other=0.0).to(tl.float32))
    else:
        w = w * scale
    return tl.reshape(w, [VALS * P, w.shape[2]])


@triton.jit
def _qgemm_kernel(
    x_ptr, qw_ptr, s_ptr, o_ptr, b_ptr, y_ptr, M, N, K, KW, G, stride_xm, P_CHUNK,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """y = x W^T (+ b) over the panels of split program_id(1); PARTIAL stores float32 sums
    to y[split] instead."""
    PC: tl.constexpr = 16 * (32 // BITS)  # columns a panel
    # The M tiles of one N tile are neighbours in launch order, so they share its weight
    # tile through L2 while it is hot.
    num_m = tl.cdiv(M, BM)
    pid = tl.program_id(0)
    pid_m, pid_n = pid % num_m, pid // num_m
    split = tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    m_mask, n_mask = m < M, n < N
    n64 = n.to(tl.int64)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BM, BN], tl.float32)
    p_start = split * P_CHUNK
    for p in range(p_start, tl.minimum(p_start + P_CHUNK, KW // 16)):
        k = p * PC + tl.arange(0, PC)
        a = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
        w = _dequant_panel(qw_ptr, s_ptr, o_ptr, n64, n_mask, p, KW, G, BITS, GROUP, HAS_OFFSET)
        if IEEE:
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
    out_mask = m_mask[:, None] & n_mask[None, :]
    offs = m.to(tl.int64)[:, None] * N + n[None, :]
    if PARTIAL:
        tl.store(y_ptr + split.to(tl.int64) * M * N + offs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _sum_splits_kernel(part_ptr, b_ptr, y_ptr, MN, N, SPLITS: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, o_ptr, w_ptr, N, K, KW, G,
                    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr,
                    BN: tl.constexpr):  # fmt: skip
    PC: tl.constexpr = 16 * (32 // BITS)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    p = tl.program_id(1)
    n_mask = n < N
    n64 = n.to(tl.int64)
    w = _dequant_panel(qw_ptr, s_ptr, o_ptr, n64, n_mask, p, KW, G, BITS, GROUP, HAS_OFFSET)
    k = p * PC + tl.arange(0, PC)
    w = tl.trans(w).to(w_ptr.dtype.element_ty)  # stored along K, as rows are laid out
    tl.store(w_ptr + n64[:, None] * K + k[None, :], w, mask=n_mask[:, None] & (k < K)[None, :])


def gemm_config(m: int, n: int, k: int, bits: int, sms: int) -> GemmConfig:
    """Tiles by the number of rows, then enough K splits that every SM gets a program."""
    if m <= 16:
        bm, bn, warps = 16, 64, 4
    elif m <= 32:
        bm, bn, warps = 32, 64, 4
    elif m <= 64:
        bm, bn, warps = 64, 64, 4
    else:
        bm, bn, warps = 128, 128, 8
    panels = triton.cdiv(k * bits // 32, PANEL)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = 1
    # Each split keeps at least four panels, so the partial sums stay a small extra.
    while tiles * split < sms and panels // (split * 2) >= 4:
        split *= 2
    return GemmConfig(bm, bn, split, warps)


def launch_gemm(
    x: torch.Tensor, w, bias: torch.Tensor | None, config: GemmConfig | None
) -> torch.Tensor:
    """x [M, K] times the packed weight: [M, N] in x's dtype."""
    m, k = x.shape
    n = w.out_features
    cfg = config or gemm_config(m, n, k, w.bits, sm_count(x.device))
    if x.stride(1) != 1:
        x = x.contiguous()
    panels = w.qweight.shape[1] // PANEL
    chunk = triton.cdiv(panels, cfg.split_k)
    splits = triton.cdiv(panels, chunk)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), splits)
    _qgemm_kernel[grid](
        x, w.qweight, w.scales, w.scales if w.offsets is None else w.offsets,
        w.scales if bias is None else bias, out, m, n, k, w.qweight.shape[1], w.scales.shape[1],
        x.stride(0), chunk, BITS=w.bits, GROUP=kernel_group(w), HAS_OFFSET=w.offsets is not None,
        HAS_BIAS=bias is not None, PARTIAL=splits > 1, IEEE=x.dtype == torch.float32,
        BM=cfg.block_m, BN=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            out, out if bias is None else bias, y, m * n, n,
            SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return y


def dequantize(w, dtype: torch.dtype) -> torch.Tensor:
    """The packed weight as a dense [N, K] matrix of dtype."""
    n, k = w.out_features, w.in_features
    out = torch.empty(n, k, dtype=dtype, device=w.qweight.device)
    bn = 64
    _dequant_kernel[(triton.cdiv(n, bn), w.qweight.shape[1] // PANEL)](
        w.qweight, w.scales, w.scales if w.offsets is None else w.offsets, out,
        n, k, w.qweight.shape[1], w.scales.shape[1],
        BITS=w.bits, GROUP=kernel_group(w), HAS_OFFSET=w.offsets is not None, BN=bn, num_warps=4,
    )  # fmt: skip
    return out
