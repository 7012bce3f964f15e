"""One row through a decoder layer with each residual add in the epilogue of the product in
front of it and each add+RMSNorm in the prologue of the product behind it: o_proj and
down_proj finish the residual stream and keep partial sums of its squares, and qkv, gate_up
and the next layer's qkv take the norm's 1 / RMS from those sums
(kernels/triton/split_sums.py), so no product reads the whole row and the residual to
normalize it. The batch-1 decode step runs this where every projection of a layer takes it
(Linear.takes_squares: the streamed GEMV, 7B's projections). int4 weights take it too
(QuantizedLinear.takes_squares), with one difference: their GEMV would pay for normalizing x
in every loop step (BENCHMARKS.md), so the residual add also stores the stream times the
next norm's weight, and the product behind multiplies its sums by the norm's 1 / RMS: two
add+RMSNorm launches fewer a layer, 7B int4's step 2.237 -> 2.191 ms (H100, 2026-12-07, one
call, graph replay). The first layer's input norm and the final norm still run in front."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SummedRow:
    """A layer's output already added to the residual stream: the stream [1, hidden], the
    float32 partial sums of its squares [1, blocks] that the next norm takes, and where the
    projection behind that norm takes it so (int4 weights), the stream times the norm's
    weight, rounded."""

    stream: torch.Tensor
    squares: torch.Tensor
    weighted: torch.Tensor | None = None


def takes_squares(*projections) -> bool:
    """Whether every projection takes summed rows, all of one kind (the streamed GEMV's,
    or the int4 GEMV's, whose rows come weighted)."""
    if not all(getattr(p, "takes_squares", False) for p in projections):
        return False
    return len({getattr(p, "takes_weighted", False) for p in projections}) == 1


def summed_mlp_half(
    heads: torch.Tensor, residual: torch.Tensor, o_proj, norm, mlp, next_norm=None
) -> SummedRow:
    """o_proj of the attention heads added to the stream, then the MLP of its norm added too;
    next_norm: the norm behind the layer (the next layer's, None for the last)."""
    row = SummedRow(*o_proj.add_row(heads, residual, norm))
    act = mlp.gate_up_proj.normed_row(row.stream, row.squares, norm, True, row.weighted)
    return SummedRow(*mlp.down_proj.add_row(act, row.stream, next_norm))
