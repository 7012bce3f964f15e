"""Triton kernels for the GPU path: each fuses what plain torch would run as several kernels.

They round to bf16/fp16 where HF does (the residual sum, the normalized activations, SiLU's
output, each RoPE product and sum), so the fused path computes the function the reference
layers compute, in one pass. On the H200, 95-98% of the keys the RoPE kernel writes are
bit-identical to the torch path and the rest one bf16 step away (tests/gpu); the source of
that last step is not pinned down yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, n_cols, x_stride, res_stride, out_stride, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        # The sum is rounded to the model dtype, as HF's residual add is.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * res_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """norm(x) or, with residual, residual += x (in place) then norm(residual)."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    res = residual if residual is not None else x
    _rms_norm_kernel[(rows,)](
        x, res, weight, out, cols, x.stride(0), res.stride(0), out.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols),
        num_warps=4 if cols <= 2048 else 8,
    )  # fmt: skip
    return out


@triton.jit
def _silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up from model-dtype inputs, rounding SiLU's output as HF does."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(dtype)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, gu_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0)
    up = tl.load(gu_ptr + row * gu_stride + n_cols + cols, mask=mask, other=0.0)
    y = _silu_mul(gate, up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + cols, y, mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2n] holding gate then up -> silu(gate) * up, [rows, n]."""
    rows, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](
        gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out


@triton.jit
def _rotate(x1, x2, cos, sin, dtype: tl.constexpr):
    """HF's q * cos + rotate_half(q) * sin with its bf16/fp16 rounding after every op."""
    c1 = (x1.to(tl.float32) * cos).to(dtype).to(tl.float32)
    s2 = (x2.to(tl.float32) * sin).to(dtype).to(tl.float32)
    c2 = (x2.to(tl.float32) * cos).to(dtype).to(tl.float32)
    s1 = (x1.to(tl.float32) * sin).to(dtype).to(tl.float32)
    return (c1 - s2).to(dtype), (c2 + s1).to(dtype)


@triton.jit
def _rope_store_kernel(
    qkv_ptr, qkv_stride, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """One program per token: rotate q in place, rotate k, and write k and v to their slot."""
    tok = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    dtype: tl.constexpr = qkv_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + tok)
    d = tl.arange(0, half)
    # HF casts the float32 tables to the activation dtype before using them.
    cos = tl.load(cos_ptr + pos * half + d).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * half + d).to(dtype).to(tl.float32)
    row = qkv_ptr + tok * qkv_stride
    for h in tl.static_range(NUM_HEADS):
        x1 = tl.load(row + h * HEAD_DIM + d)
        x2 = tl.load(row + h * HEAD_DIM + half + d)
        r1, r2 = _rotate(x1, x2, cos, sin, dtype)
        tl.store(row + h * HEAD_DIM + d, r1)
        tl.store(row + h * HEAD_DIM + half + d, r2)
    slot = tl.load(slot_ptr + tok)
    k_row = row + NUM_HEADS * HEAD_DIM
    v_row = k_row + NUM_KV_HEADS * HEAD_DIM
    cache = slot * NUM_KV_HEADS * HEAD_DIM
    for h in tl.static_range(NUM_KV_HEADS):
        x1 = tl.load(k_row + h * HEAD_DIM + d)
        x2 = tl.load(k_row + h * HEAD_DIM + half + d)
        r1, r2 = _rotate(x1, x2, cos, sin, dtype)
        tl.store(k_cache_ptr + cache + h * HEAD_DIM + d, r1)
        tl.store(k_cache_ptr + cache + h * HEAD_DIM + half + d, r2)
        tl.store(v_cache_ptr + cache + h * HEAD_DIM + d, tl.load(v_row + h * HEAD_DIM + d))
        tl.store(
            v_cache_ptr + cache + h * HEAD_DIM + half + d,
            tl.load(v_row + h * HEAD_DIM + half + d),
        )


def rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_half: torch.Tensor,
    sin_half: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """q, k, v are the three column ranges of one qkv row-major buffer (q first, then k, v):
    rotates q in place and writes rotated k plus v into the paged cache."""
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    _rope_store_kernel[(tokens,)](
        q, q.stride(0), positions, cos_half, sin_half, slot_mapping, k_cache, v_cache,
        NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, num_warps=1,
    )  # fmt: skip
