"""SiLU(gate) * up over the MLP's fused gate_up output, with SiLU's output rounded as HF
rounds it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoqwen.kernels.triton.pdl import use_pdl


@triton.jit
def _silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up from model-dtype inputs, rounding SiLU's output as HF does."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(dtype)


@triton.jit
def _silu_mul_kernel(
    gu_ptr, out_ptr, n_cols, gu_stride, out_stride, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
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
    pdl = use_pdl(gate_up)
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](
        gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block, PDL=pdl,
        launch_pdl=pdl, num_warps=4,
    )  # fmt: skip
    return out
