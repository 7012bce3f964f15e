"""LayerOps: the kernels a decoder layer's norms, MLP and small projections run on one
device, chosen once when the engine is built. Where an op is None the layer runs plain torch
in HF's exact order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerOps:
    name: str
    # (x, weight, eps, residual or None) -> (norm(x + residual), x + residual)
    add_rms_norm: Callable | None = None
    # [rows, 2n] = [gate | up] -> silu(gate) * up
    silu_mul: Callable | None = None
    # one row through a dense weight, bias included: (x, weight, bias) -> x @ weight.T + bias
    gemv: Callable | None = None
    # one row through gate_up with SiLU·up in the epilogue: (x, weight) -> silu(gate) * up
    gemv_silu_mul: Callable | None = None
    # whether the single-row GEMVs take a weight (where they beat the library's matmul)
    gemv_pays: Callable[[torch.Tensor], bool] = lambda weight: False
    # gemv and gemv_silu_mul with the add+RMSNorm in front of them in the same launch:
    # (x, residual or None, norm weight, eps, weight[, bias]) -> (output, x + residual)
    norm_gemv: Callable | None = None
    norm_gemv_silu_mul: Callable | None = None
    # norm_gemv of the first layer, its input read from the embedding table by the GEMV:
    # (table, ids of one token, norm weight, eps, weight, bias) -> (output, the table's row)
    embed_norm_gemv: Callable | None = None
    # one row's final add+RMSNorm and the lm_head after it, float32 logits:
    # (x, residual or None, norm weight, eps, lm_head weight, out or None) -> logits [1, vocab]
    norm_logits: Callable | None = None
    # One row with the residual add in the epilogue of the product in front of it, which
    # keeps partial sums of the stream's squares, and the add+RMSNorm behind it taking its
    # 1 / RMS from them (kernels/triton/split_sums.py), for the weights `streams` takes:
    # (x, weight, bias, residual) -> (residual + x @ weight.T + bias, squares), and
    # (stream, squares, norm weight, eps, weight, bias, silu_mul) -> the product
    streams: Callable[[torch.Tensor], bool] = lambda weight: False
    gemv_add: Callable | None = None
    squares_norm_gemv: Callable | None = None


TORCH_OPS = LayerOps("torch")


def triton_ops() -> LayerOps:
    """bf16/fp16 on CUDA: the Triton add+norm, SiLU·up and single-row GEMVs."""
    from nanoqwen.kernels.triton.gemv import (
        embed_norm_gemv,
        gemv,
        gemv_add,
        gemv_pays,
        gemv_silu_mul,
        norm_gemv,
        norm_gemv_silu_mul,
        squares_norm_gemv,
        streams,
    )
    from nanoqwen.kernels.triton.rms_norm import rms_norm
    from nanoqwen.kernels.triton.silu_mul import silu_mul
    from nanoqwen.kernels.triton.stream_gemv import stream_gemv

    def add_rms_norm(x, weight, eps, residual):
        if residual is None:
            return rms_norm(x, weight, eps), x
        return rms_norm(x, weight, eps, residual), residual  # residual summed in place

    def norm_logits(x, residual, norm_weight, eps, weight, out=None):
        norm = (residual, norm_weight, eps)
        return stream_gemv(x, weight, norm=norm, out_dtype=torch.float32, out=out)[0]

    return LayerOps(
        "triton", add_rms_norm, silu_mul, gemv, gemv_silu_mul, gemv_pays,
        norm_gemv, norm_gemv_silu_mul, embed_norm_gemv, norm_logits, streams, gemv_add,
        squares_norm_gemv,
    )  # fmt: skip


def cpu_ops() -> LayerOps:
    """bf16 on the CPU: the C add+norm and SiLU·up (kernels/cpu/cpu_ops.c), HF's roundings."""
    from nanoqwen.kernels.cpu.cpu_ops import add_rms_norm, silu_mul

    return LayerOps("cpu", add_rms_norm, silu_mul)
