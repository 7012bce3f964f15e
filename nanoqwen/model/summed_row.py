"""One row through a decoder layer with each residual add in the epilogue of the product in
front of it and each add+RMSNorm in the prologue of the product behind it: o_proj and
down_proj finish the residual stream and keep partial sums of its squares, and qkv, gate_up
and the next layer's qkv take the norm's 1 / RMS from those sums
(kernels/triton/split_sums.py), so no product reads the whole row and the residual to
normalize it. The batch-1 decode step runs this where every projection of a layer takes it
(Linear.takes_squares: the streamed GEMV, 7B's projections). Projections without it (int4
weights, whose GEMV would normalize x in every loop step: BENCHMARKS.md) run the layer as
before."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SummedRow:
    """A layer's output already added to the residual stream: the stream [1, hidden], and
    the float32 partial sums of its squares [1, blocks] that the next norm takes."""

    stream: torch.Tensor
    squares: torch.Tensor


def takes_squares(*projections) -> bool:
    return all(getattr(p, "takes_squares", False) for p in projections)


def summed_mlp_half(heads: torch.Tensor, residual: torch.Tensor, o_proj, norm, mlp) -> SummedRow:
    """o_proj of the attention heads added to the stream, then the MLP of its norm added too."""
    stream, squares = o_proj.add_row(heads, residual)
    act = mlp.gate_up_proj.normed_row(stream, squares, norm, silu_mul=True)
    return SummedRow(*mlp.down_proj.add_row(act, stream))
