"""The per-step message from rank 0 to the other ranks.

A step is a small fixed header over the gloo control group (what kind of step, the sizes of
its parts, which CUDA graph) and then one broadcast of the step's StepBuffer
(runtime/step_buffer.py), on the step's device (NCCL between GPUs), so rank 0 never waits
for the GPU to send it. A CUDA graph's replay broadcasts its own inputs, as its first kernel
(runtime/cuda_graph.py, runtime/prefill_graph.py). Host work the others must repeat (KV
block copies to and from the host pool, the row ranges of prompt logprobs) rides in an extra
control message on the steps that have any.
"""

from __future__ import annotations

from enum import IntEnum

import torch
import torch.distributed as dist

from nanoqwen.runtime.parallel.group import ParallelContext
from nanoqwen.runtime.step_inputs import StepInputs, step_layout, step_metadata


class Op(IntEnum):
    STEP = 1  # a prefill or eager decode step: inputs in the packed payload
    GRAPH = 2  # a CUDA graph replay: inputs are the graph runner's static buffer
    SHUTDOWN = 3
    PREFILL_GRAPH = 4  # a prefill graph's replay: GRAPH_BS its bucket, GRAPH_VARIANT its logit rows


class Field(IntEnum):
    OP = 0
    PAYLOAD = 1  # int64 entries in the payload
    TOKENS = 2
    SEQS = 3
    WIDTH = 4  # block table columns
    MAX_Q = 5
    MAX_K = 6
    ROWS = 7  # prefill rows that get logits
    PREFILL = 8
    PENDING = 9  # decode ids include placeholders (sources follow the slots)
    EXTRA = 10  # int64 entries in the extra control message
    PROMPT_ROWS = 11  # prompt logprob row ranges at the start of the extra message
    GRAPH_BS = 12
    GRAPH_VARIANT = 13
    GRAPH_FILTERING = 14
    GRAPH_CASCADE = 15


HEADER_SIZE = 16


def header(op: Op, **fields: int) -> list[int]:
    h = [0] * HEADER_SIZE
    h[Field.OP] = int(op)
    for name, value in fields.items():
        h[Field[name.upper()]] = int(value)
    return h


def step_header(inputs: StepInputs) -> list[int]:
    """The header of a STEP message: the sizes that make its StepBuffer layout."""
    return header(
        Op.STEP,
        payload=inputs.layout().entries,
        tokens=len(inputs.ids),
        seqs=len(inputs.context_lens),
        width=inputs.width,
        max_q=inputs.max_seqlen_q,
        max_k=inputs.max_seqlen_k,
        rows=len(inputs.logit_rows),
        prefill=inputs.is_prefill,
        pending=inputs.sources is not None,
    )


def step_of(h: list[int], buffer: torch.Tensor):
    """(ids, metadata, logit rows or None) as views of a STEP's buffer on its device."""
    prefill = bool(h[Field.PREFILL])
    layout = step_layout(
        h[Field.TOKENS], h[Field.SEQS], h[Field.WIDTH], h[Field.ROWS], prefill,
        bool(h[Field.PENDING]),
    )  # fmt: skip
    f = layout.views(buffer)
    meta = step_metadata(f, prefill, h[Field.MAX_Q], h[Field.MAX_K])
    return f.ids, meta, f.logit_rows if prefill else None


class StepChannel:
    """Rank 0 sends, the others receive, in the same order."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx
        self._header = torch.zeros(HEADER_SIZE, dtype=torch.int64)

    def send(self, h: list[int], extra: list[int]) -> None:
        h[Field.EXTRA] = len(extra)
        self._header.copy_(torch.tensor(h, dtype=torch.int64))
        dist.broadcast(self._header, 0, group=self.ctx.control)
        if extra:
            dist.broadcast(torch.tensor(extra, dtype=torch.int64), 0, group=self.ctx.control)

    def receive(self) -> tuple[list[int], list[int]]:
        dist.broadcast(self._header, 0, group=self.ctx.control)
        h = self._header.tolist()
        extra: list[int] = []
        if h[Field.EXTRA]:
            t = torch.empty(h[Field.EXTRA], dtype=torch.int64)
            dist.broadcast(t, 0, group=self.ctx.control)
            extra = t.tolist()
        return h, extra

    def share(self, tensor: torch.Tensor) -> None:
        """Rank 0's tensor into every rank's (same shape and device type), queued on the
        device: no rank waits for it on the host."""
        dist.broadcast(tensor, 0, group=self.ctx.tp.group)


def encode_copies(ops: list[tuple[int, list[int], list[int]]]) -> list[int]:
    """Host-pool copies as ints: per copy its direction (0 out, 1 in), count, then the two
    block lists in copy_out / copy_in argument order."""
    out: list[int] = []
    for direction, a, b in ops:
        out += [direction, len(a), *a, *b]
    return out


def decode_copies(ints: list[int]) -> list[tuple[int, list[int], list[int]]]:
    ops, i = [], 0
    while i < len(ints):
        direction, n = ints[i], ints[i + 1]
        a, b = ints[i + 2 : i + 2 + n], ints[i + 2 + n : i + 2 + 2 * n]
        ops.append((direction, a, b))
        i += 2 + 2 * n
    return ops
