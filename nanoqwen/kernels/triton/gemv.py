"""Matrix-vector products for batch-1 decode of small projections.

At one token a projection is a pure weight stream, and for a small weight matrix cuBLAS's
M=1 kernels are latency bound (a 2-17 MB matrix read at 0.4-3.5 TB/s) and come with extra
kernels: a bias copy, a split-K reduce, the MLP's SiLU·up. A plain Triton kernel that gives
each program a few weight rows does the product and the bias or SiLU·up epilogue in one
launch. Inside the H200 decode graph: 0.5B's projections took 0.59 ms this way against
0.64 ms for cuBLAS with its extra kernels; 7B's (26-272 MB) took 4.34 ms against 3.98 ms,
so large matrices stay with cuBLAS (GEMV_MAX_BYTES).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoqwen.kernels.triton.silu_mul import _silu_mul

GEMV_MAX_BYTES = 20 << 20


def gemv_pays(weight: torch.Tensor) -> bool:
    return weight.numel() * weight.element_size() <= GEMV_MAX_BYTES


def _blocks(n: int, k: int) -> tuple[int, int]:
    """(rows, columns) of weight per program step, from a sweep over the Qwen2.5 shapes."""
    if k >= 4 * n:
        rows = 2  # long rows (down_proj): many programs
    elif n >= 8192 and k <= 1024:
        rows = 16  # many short rows (0.5B gate_up, lm_head)
    elif n >= 4096:
        rows = 8
    elif n * k >= 8 << 20:
        rows = 4
    else:
        rows = 2
    return rows, min(1024 if k <= 1024 else 512, 4096 // rows)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """y = W x (+ b) for rows BN*pid..; with SILU_MUL, W holds gate rows then N up rows and
    y = silu(W_gate x) * (W_up x)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    r_mask = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    up_rows = w_rows + N * K
    acc = tl.zeros([BN, BK], tl.float32)
    acc_up = tl.zeros([BN, BK], tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        c_mask = cols < K
        mask = r_mask[:, None] & c_mask[None, :]
        x = tl.load(x_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        acc += tl.load(w_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32) * x
        if SILU_MUL:
            acc_up += tl.load(up_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32) * x
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
    if SILU_MUL:
        # Both projections round to the model dtype first, as the unfused path's GEMM does.
        y = _silu_mul(y.to(dtype), tl.sum(acc_up, 1).to(dtype), dtype)
    tl.store(y_ptr + rows, y.to(dtype), mask=r_mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x of one row: [1, K] -> [1, N]."""
    n, k = weight.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    rows, cols = _blocks(n, k)
    _gemv_kernel[(triton.cdiv(n, rows),)](
        x.contiguous(), weight, weight if bias is None else bias, y, n, k,
        HAS_BIAS=bias is not None, SILU_MUL=False, BN=rows, BK=cols, num_warps=4, num_stages=3,
    )  # fmt: skip
    return y


def gemv_silu_mul(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) for x of one row, gate_up = [W_gate; W_up]: [1, N]."""
    two_n, k = gate_up.shape
    n = two_n // 2
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    rows, cols = _blocks(two_n, k)
    rows = max(1, rows // 2)  # each program reads as many gate rows as up rows
    _gemv_kernel[(triton.cdiv(n, rows),)](
        x.contiguous(), gate_up, gate_up, y, n, k,
        HAS_BIAS=False, SILU_MUL=True, BN=rows, BK=cols, num_warps=4, num_stages=3,
    )  # fmt: skip
    return y
