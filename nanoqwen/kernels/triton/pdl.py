"""Programmatic dependent launch (PDL, sm_90 and later) for batch-1 decode.

A kernel launched as a programmatic dependent may start while the kernel in front of it is
still running: it reads what does not depend on that kernel (weights, the step's inputs)
first, then waits (gdc_wait) until that kernel has finished and its writes are visible. A
batch-1 decode step is ~150 short kernels in a row; launched this way, each kernel's launch
and first loads overlap the tail of the one before. Measured on the H200 (random weights,
bench latency mode, one call): 0.5B 0.895 -> 0.645 ms a step, 7B 4.478 -> 4.408 ms.

The rules that keep it exact: a kernel launched this way waits before its first read of an
earlier kernel's output and before its first store, and every one of its programs that
stores anything has waited, so a finished kernel implies that everything in front of it has
finished too; kernels launched without it (cuBLAS, torch) wait for everything in front of
them as usual, and CUDA graphs capture the dependency as it is.

Only single-row launches use it (batches above one are not measured), and the sampler's
top-p rounds (nucleus_draw.py) at any batch: ROUNDS launches of one kernel in a row, each
waiting on the one before. Most kernels let the one behind them launch
(gdc_launch_dependents) at their start; a streamed GEMV whose grid is more than one wave
(7B's gate_up) only once its programs are past their loops, so that the waiting programs do
not hold SMs its later programs need. The int4 GEMV does the same by its grid's size: at
most two programs an SM (7B's o_proj and down_proj) lets the next kernel launch at its
start, a larger grid (qkv, gate_up) at the end of its loops; 7B int4's step 2.603 -> 2.455
ms (H100, 2026-12-05). Letting every int4 grid's next kernel launch at its start had made
it 2.425 -> 3.687 ms (H200).
NANOQWEN_PDL=0 turns it off (A/B runs, bisecting a suspected race).
"""

from __future__ import annotations

import functools
import os

import torch

ENABLED = os.environ.get("NANOQWEN_PDL", "1") != "0"


@functools.cache
def _capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_available(device: torch.device) -> bool:
    """Whether kernels on device may launch as programmatic dependents at all."""
    return ENABLED and device.type == "cuda" and _capable(device)


def use_pdl(t: torch.Tensor) -> bool:
    """Whether a kernel over t, a single row (one token, or one sequence's), launches as a
    programmatic dependent."""
    return t.shape[0] == 1 and pdl_available(t.device)
