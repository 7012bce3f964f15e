"""Verify steps captured as CUDA graphs: the model over each sequence's newest token and its
proposals, lm_head on every row, and the sampler depth by depth, in one replay.

Eagerly, a verify step of a few rows is bound by the CPU as a decode step is (hundreds of
launches through torch's dispatcher), plus one sampler pass per depth. A graph serves bs
sequences of exactly width = k + 1 rows each (k: num_speculative_tokens):

- a sequence with p < k proposals fills its rows past 1 + p with token 0 at the positions
  that follow; their keys go to the KV cache's scratch block and attention is causal, so its
  real rows never see them, and they sample in the sampler's scratch slot;
- padding sequences (bs above the batch) are width rows over the scratch block alone.

The sampler runs once per depth j over rows j, width + j, 2 * width + j, ... (one per
sequence), so each row's penalties and noise position follow the rows before it, as
verify_rows does eagerly (spec/verify.py); the graph then takes back the rows past each
sequence's first rejection, which verify_rows leaves to the host.
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.runtime.cuda_graph import capture_sizes
from nanoqwen.runtime.graph_capture import capture
from nanoqwen.runtime.graph_logits import allocate_graph_logits
from nanoqwen.runtime.kv.cache import KVCache
from nanoqwen.runtime.sequence import Sequence
from nanoqwen.runtime.step_buffer import Layout, StepBuffer

# Above this many rows the GPU's work outlasts the CPU's launches, and eager costs little.
MAX_ROWS = 128


def verify_sizes(k: int, max_num_seqs: int) -> list[int]:
    """The batch sizes captured for k proposals: decode's, while their rows fit MAX_ROWS."""
    width = k + 1
    return [s for s in capture_sizes(max_num_seqs) if s == 1 or s * width <= MAX_ROWS]


def verify_rows(k: int, max_num_seqs: int) -> int:
    """The rows of the largest verify graph."""
    return verify_sizes(k, max_num_seqs)[-1] * (k + 1)


def verify_layout(bs: int, width: int, table_width: int) -> Layout:
    """int64: ids, positions and KV slots per row (sequence by sequence), the sampler slots
    depth by depth; int32: cu_seqlens_k, context lengths, block tables."""
    rows = bs * width
    return Layout.of(
        int64={"ids": rows, "pos": rows, "slots": rows, "sampler_slots": rows},
        int32={"cu_k": bs + 1, "ctx": bs, "tables": (bs, table_width)},
    )


class VerifyGraphRunner:
    def __init__(
        self,
        k: int,
        max_num_seqs: int,
        kv: KVCache,
        sampler_scratch: int,
        logits: torch.Tensor | None = None,
    ) -> None:
        """logits: the engine's graph output buffer (graph_logits.py), at least
        verify_rows(k, max_num_seqs) rows; None: one of its own at capture."""
        self.width = k + 1
        self.sizes = verify_sizes(k, max_num_seqs)
        self.kv = kv
        self.sampler_scratch = sampler_scratch
        self.logits = logits
        # (batch size, filtering) -> (graph, logits [bs * width, vocab], tokens [width, bs])
        self.graphs: dict[tuple[int, bool], tuple] = {}
        self.meta: dict[int, AttentionMetadata] = {}

    def _allocate(self, device: torch.device, max_model_len: int, max_positions: int) -> None:
        bs, block_size = self.sizes[-1], self.kv.block_size
        self.max_bs = bs
        self.max_model_len = max_model_len
        self.max_positions = max_positions
        # Filler rows of a sequence at the longest length reach k positions past it.
        self.table_width = -(-(max_model_len + self.width) // block_size)
        self.buffer = StepBuffer(verify_layout(bs, self.width, self.table_width), device)
        self.fields = self.buffer.fields
        self.cu_q = torch.arange(0, bs * self.width + 1, self.width, dtype=torch.int32,
                                 device=device)  # fmt: skip

    def _fill_padding(self, h, start: int, end: int) -> None:
        """Sequences start:end become padding: width rows over the scratch block."""
        if start >= end:
            return
        w, bs, scratch = self.width, self.kv.block_size, self.kv.scratch_block
        rows = slice(start * w, end * w)
        offsets = np.tile(np.arange(w), end - start)
        h.ids[rows] = 0
        h.pos[rows] = offsets
        h.slots[rows] = scratch * bs + offsets % bs
        h.ctx[start:end] = w
        h.tables[start:end] = scratch
        h.sampler_slots.reshape(w, self.max_bs)[:, start:end] = self.sampler_scratch

    def _static_meta(self, bs: int) -> AttentionMetadata:
        f, rows = self.fields, bs * self.width
        return AttentionMetadata(
            is_prefill=True,
            positions=f.pos[:rows],
            slot_mapping=f.slots[:rows],
            context_lens=f.ctx[:bs],
            block_tables=f.tables[:bs],
            cu_seqlens_q=self.cu_q[: bs + 1],
            max_seqlen_q=self.width,
            max_seqlen_k=self.max_model_len + self.width,
            cu_seqlens_k=f.cu_k[: bs + 1],
            padded=True,
            uniform_q=self.width,
        )

    def setup(self, runner, max_model_len: int) -> None:
        """The buffers and metadata every graph reads, all padding to begin with (what the
        capture warm-ups run on)."""
        self.model, self.sampler = runner.model, runner.sampler
        self._allocate(runner.device, max_model_len, runner.model.rotary.max_positions)
        if self.logits is None:
            self.logits = allocate_graph_logits(self.max_bs * self.width, runner.model)
        for h in self.buffer.host_fields:
            self._fill_padding(h, 0, self.max_bs)
            h.cu_k[:] = np.arange(self.max_bs + 1) * self.width
        self.buffer.send()
        self.meta = {bs: self._static_meta(bs) for bs in self.sizes}

    @torch.inference_mode()
    def capture(self, runner, max_model_len: int, pool=None, progress: bool = True) -> None:
        """pool: the decode graphs' memory pool, shared (no two graphs ever run at once)."""
        self.setup(runner, max_model_len)
        keys = [(bs, f) for bs in sorted(self.sizes, reverse=True) for f in (False, True)]
        for key in tqdm(keys, desc="Capturing verify graphs", disable=not progress, leave=False):
            self.forward(key)  # warm-up: compiles, autotuning
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with capture(graph, pool):
                logits, tokens = self.forward(key)
            pool = graph.pool()
            self.graphs[key] = (graph, logits, tokens)
        torch.cuda.synchronize()

    def forward(self, key: tuple[int, bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """What the graph of key runs, over the buffer as it is."""
        bs, filtering = key
        model, sampler = self.model, self.sampler
        self.meta[bs].shared.clear()  # what the first layer derives from this step's rows
        rows = bs * self.width
        x, residual = model(self.fields.ids[:rows], self.meta[bs])
        logits = model.compute_logits((x, residual), out=self.logits[:rows])
        slots = self.fields.sampler_slots.view(self.width, self.max_bs)[:, :bs]
        # Depth j's rows j, width + j, ...: a strided view, which the sampler reads in place.
        depths = logits.view(bs, self.width, -1)
        tokens = torch.stack([
            sampler(depths[:, j], slots[j], filtering) for j in range(self.width)
        ])  # fmt: skip
        # Rows past a sequence's first rejected proposal were counted as outputs of its slot
        # (penalties, positions): take them back here, so the host has nothing to send
        # after the replay. Row j stays while every proposal before it matched its row's
        # token (filler rows sample into the scratch slot, where what stays does not matter).
        proposed = self.fields.ids[: bs * self.width].view(bs, self.width)[:, 1:].t()
        matched = (tokens[:-1] == proposed).to(torch.int32).cumprod(0, dtype=torch.int32)
        sampler.state.unrecord(slots[1:].reshape(-1), tokens[1:].reshape(-1),
                               (1 - matched).reshape(-1))  # fmt: skip
        return logits, tokens

    def can_run(self, seqs: list[Sequence], proposals: list[list[int]]) -> bool:
        return (
            bool(self.graphs)
            and len(seqs) <= self.max_bs
            and max(len(p) for p in proposals) < self.width
        )

    @torch.inference_mode()
    def prepare(
        self,
        seqs: list[Sequence],
        proposals: list[list[int]],
        slots_of: list[list[int]],
        sampler_slots: list[int],
        filtering: int,
    ) -> tuple[int, bool]:
        """Writes the verify step into the graphs' buffer and sends it; returns the key of
        the graph to replay. slots_of: each sequence's KV slots for its 1 + p real rows."""
        n, w = len(seqs), self.width
        bs = next(s for s in self.sizes if s >= n)
        h = self.buffer.host()
        block_size, scratch = self.kv.block_size, self.kv.scratch_block
        depth_slots = h.sampler_slots.reshape(w, self.max_bs)
        for i, (seq, proposal, kv_slots) in enumerate(zip(seqs, proposals, slots_of)):
            start, real = len(seq) - 1, 1 + len(proposal)
            rows = slice(i * w, (i + 1) * w)
            h.ids[rows] = [seq.token_ids[-1], *proposal] + [0] * (w - real)
            # Filler positions past the RoPE table would index outside it.
            h.pos[rows] = np.minimum(np.arange(start, start + w), self.max_positions - 1)
            h.slots[i * w : i * w + real] = kv_slots
            h.slots[i * w + real : (i + 1) * w] = scratch * block_size + np.arange(w - real)
            h.ctx[i] = start + w
            h.tables[i, : len(seq.block_table)] = seq.block_table
            depth_slots[:real, i] = sampler_slots[i]
            depth_slots[real:, i] = self.sampler_scratch
        self._fill_padding(h, n, bs)
        h.cu_k[1 : bs + 1] = np.cumsum(h.ctx[:bs])
        self.buffer.send()
        return bs, bool(filtering)  # FULL's graph samples a NUCLEUS batch too

    def replay(self, key: tuple[int, bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """Replays the graph of key; returns its [bs * width, vocab] logits and its
        [width, bs] tokens (depth by depth), the graph's own output buffers."""
        graph, logits, tokens = self.graphs[key]
        graph.replay()
        return logits, tokens
