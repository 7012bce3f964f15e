"""Residual add + RMSNorm in one pass, rounding to bf16/fp16 where HF does (the sum, the
normalized activations)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoqwen.kernels.triton.pdl import use_pdl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, n_cols, x_stride, res_stride, out_stride, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if PDL:
        gdc_wait()
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        # The sum is rounded to the model dtype, as HF's residual add is.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * res_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """norm(x) or, with residual, residual += x (in place) then norm(residual)."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    res = residual if residual is not None else x
    pdl = use_pdl(x)
    _rms_norm_kernel[(rows,)](
        x, res, weight, out, cols, x.stride(0), res.stride(0), out.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols),
        PDL=pdl, launch_pdl=pdl, num_warps=4 if cols <= 2048 else 8,
    )  # fmt: skip
    return out
