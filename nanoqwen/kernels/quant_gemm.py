"""Weight-only quantized matrix products for more than one row, on the tensor cores.

Each program dequantizes a [BK, BN] tile of the packed weight into x's dtype in registers and
feeds it to tl.dot with a [BM, BK] tile of x, so the weight is read from HBM in its packed
form. Decode batches are a handful of rows and a projection has few BN-column tiles, so a
small grid splits K as well (`split_k`): each split writes float32 partial sums and one
reduction adds them in a fixed order (deterministic, no atomics). Large M (prefill) can also
dequantize the whole matrix once (`dequantize`) and leave the product to cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanoqwen.kernels.quant_gemv import _dequant_values, kernel_group, sm_count


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _dequant_tile(qw_ptr, s_ptr, o_ptr, n, n_mask, k, k_mask, KW, G,
                  BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr):  # fmt: skip
    """The float32 weights w[n, k] for column vectors k [BK] and row vectors n [BN]: [BK, BN].

    Column k is value (k % panel) // PANEL of word k // panel * PANEL + k % PANEL, where a
    panel holds PANEL words (kernels/quant_matmul.py). A word is loaded once per value it
    holds; the repeats hit L1."""
    VALS: tl.constexpr = 32 // BITS
    P: tl.constexpr = 16  # PANEL
    n64 = n.to(tl.int64)
    mask = k_mask[:, None] & n_mask[None, :]
    word = k // (P * VALS) * P + k % P
    shift = (k % (P * VALS) // P * BITS)[:, None]
    words = tl.load(qw_ptr + n64[None, :] * KW + word[:, None], mask=mask, other=0)
    w = _dequant_values(words, shift, BITS)
    g_off = n64[None, :] * G + (k // GROUP)[:, None]
    scale = tl.load(s_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        return tl.fma(w, scale, tl.load(o_ptr + g_off, mask=mask, other=0.0).to(tl.float32))
    return w * scale


@triton.jit
def _qgemm_kernel(
    x_ptr, qw_ptr, s_ptr, o_ptr, b_ptr, y_ptr, M, N, K, KW, G, stride_xm, K_CHUNK,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """y = x W^T (+ b) over the K range of split program_id(1); PARTIAL stores float32 sums
    to y[split] instead."""
    # The M tiles of one N tile are neighbours in launch order, so they share its weight
    # tile through L2 while it is hot.
    num_m = tl.cdiv(M, BM)
    pid = tl.program_id(0)
    pid_m, pid_n = pid % num_m, pid // num_m
    split = tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    m_mask, n_mask = m < M, n < N
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BM, BN], tl.float32)
    k_start = split * K_CHUNK
    for k0 in range(k_start, tl.minimum(k_start + K_CHUNK, K), BK):
        k = k0 + tl.arange(0, BK)
        k_mask = k < K
        a = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = _dequant_tile(
            qw_ptr, s_ptr, o_ptr, n, n_mask, k, k_mask, KW, G, BITS, GROUP, HAS_OFFSET
        )
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
                    BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    n_mask, k_mask = n < N, k < K
    w = _dequant_tile(qw_ptr, s_ptr, o_ptr, n, n_mask, k, k_mask, KW, G, BITS, GROUP, HAS_OFFSET)
    offs = n.to(tl.int64)[:, None] * K + k[None, :]
    w = tl.trans(w).to(w_ptr.dtype.element_ty)  # stored along K, as rows are laid out
    tl.store(w_ptr + offs, w, mask=n_mask[:, None] & k_mask[None, :])


def gemm_config(m: int, n: int, k: int, sms: int) -> GemmConfig:
    """Tiles by the number of rows, then enough K splits that every SM gets a program."""
    if m <= 16:
        bm, bn, bk, warps = 16, 64, 128, 4
    elif m <= 32:
        bm, bn, bk, warps = 32, 64, 128, 4
    elif m <= 64:
        bm, bn, bk, warps = 64, 64, 64, 4
    else:
        bm, bn, bk, warps = 128, 128, 64, 8
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = 1
    # Each split keeps at least four K steps, so the partial sums stay a small extra.
    while tiles * split < sms and triton.cdiv(k, bk * split * 2) >= 4:
        split *= 2
    return GemmConfig(bm, bn, bk, split, warps)


def launch_gemm(
    x: torch.Tensor, w, bias: torch.Tensor | None, config: GemmConfig | None
) -> torch.Tensor:
    """x [M, K] times the packed weight: [M, N] in x's dtype."""
    m, k = x.shape
    n = w.out_features
    cfg = config or gemm_config(m, n, k, sm_count(x.device))
    if x.stride(1) != 1:
        x = x.contiguous()
    chunk = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, chunk)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), splits)
    _qgemm_kernel[grid](
        x, w.qweight, w.scales, w.scales if w.offsets is None else w.offsets,
        w.scales if bias is None else bias, out, m, n, k, w.qweight.shape[1], w.scales.shape[1],
        x.stride(0), chunk, BITS=w.bits, GROUP=kernel_group(w), HAS_OFFSET=w.offsets is not None,
        HAS_BIAS=bias is not None, PARTIAL=splits > 1, IEEE=x.dtype == torch.float32,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
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
    bn, bk = 64, 64
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        w.qweight, w.scales, w.scales if w.offsets is None else w.offsets, out,
        n, k, w.qweight.shape[1], w.scales.shape[1],
        BITS=w.bits, GROUP=kernel_group(w), HAS_OFFSET=w.offsets is not None, BN=bn, BK=bk,
        num_warps=4,
    )  # fmt: skip
    return out
