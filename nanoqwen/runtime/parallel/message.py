"""The per-step message from rank 0 to the other ranks.

A step is a small fixed header over the gloo control group (what kind of step, the sizes of
its parts, which CUDA graph) and then one broadcast of the step's inputs packed into a single
int64 tensor, on the step's device (NCCL between GPUs), so rank 0 never waits for the GPU to
send it. A CUDA graph's replay broadcasts its own inputs, as its first kernel
(runtime/cuda_graph.py, runtime/prefill_graph.py). Host work the others must repeat (KV
block copies to and from the host pool, the row ranges of prompt logprobs) rides in an extra
control message on the steps that have any.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch
import torch.distributed as dist

from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.runtime.parallel.group import ParallelContext
from nanoqwen.runtime.step_inputs import StepInputs


class Op(IntEnum):
    STEP = 1  # a prefill or eager decode step: inputs in the packed payload
    GRAPH = 2  # a CUDA graph replay: inputs are the graph runner's static buffer
    SHUTDOWN = 3
    PREFILL_GRAPH = 4  # a prefill graph's replay: GRAPH_BS is its bucket


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


def pack(inputs: StepInputs) -> tuple[list[int], np.ndarray]:
    """(header, payload) of a STEP message."""
    parts = [inputs.ids, inputs.positions, inputs.slots]
    if inputs.sources is not None:
        parts.append(inputs.sources)
    parts += [inputs.context_lens, inputs.cu_seqlens_q]
    if inputs.is_prefill:
        parts.append(inputs.cu_seqlens_k)
    parts += [[b for row in inputs.block_tables for b in row], inputs.logit_rows]
    payload = np.fromiter(
        (v for part in parts for v in part), dtype=np.int64, count=sum(map(len, parts))
    )
    h = header(
        Op.STEP,
        payload=len(payload),
        tokens=len(inputs.ids),
        seqs=len(inputs.context_lens),
        width=inputs.width,
        max_q=inputs.max_seqlen_q,
        max_k=inputs.max_seqlen_k,
        rows=len(inputs.logit_rows),
        prefill=inputs.is_prefill,
        pending=inputs.sources is not None,
    )
    return h, payload


def unpack(h: list[int], payload: torch.Tensor):
    """(ids, metadata, logit rows or None, placeholder sources or None) as views and casts of
    the payload on its device: host arithmetic on the header only, no sync."""
    tokens, seqs, width = h[Field.TOKENS], h[Field.SEQS], h[Field.WIDTH]
    prefill = bool(h[Field.PREFILL])
    sizes = [tokens, tokens, tokens]
    sizes += [tokens] if h[Field.PENDING] else []
    sizes += [seqs, seqs + 1] + ([seqs + 1] if prefill else []) + [seqs * width, h[Field.ROWS]]
    parts = list(payload.split(sizes))
    ids, positions, slots = parts[:3]
    sources = parts.pop(3) if h[Field.PENDING] else None
    ctx, cu_q = parts[3].to(torch.int32), parts[4].to(torch.int32)
    cu_k = parts[5].to(torch.int32) if prefill else None
    tables, rows = parts[-2].to(torch.int32).view(seqs, width), parts[-1]
    meta = AttentionMetadata(
        is_prefill=prefill,
        positions=positions,
        slot_mapping=slots,
        context_lens=ctx,
        block_tables=tables,
        cu_seqlens_q=cu_q,
        max_seqlen_q=h[Field.MAX_Q],
        max_seqlen_k=h[Field.MAX_K],
        cu_seqlens_k=cu_k,
    )
    return ids, meta, rows if prefill else None, sources


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
