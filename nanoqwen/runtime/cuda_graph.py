"""Decode steps captured as CUDA graphs: one replay instead of hundreds of kernel launches."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from tqdm import tqdm

from nanoqwen.attention.cascade import shared_prefix_blocks
from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.runtime.graph_capture import capture
from nanoqwen.runtime.graph_logits import allocate_graph_logits
from nanoqwen.runtime.kv.cache import KVCache
from nanoqwen.runtime.sampling.filter_stage import FilterStage
from nanoqwen.runtime.step_buffer import Layout, StepBuffer


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def graph_layout(n: int, width: int) -> Layout:
    """The decode graphs' buffer for batches of up to n rows and block tables width wide.

    int64: ids, positions, KV slots, for a token still in flight the row of the previous
    step's output that holds it, and each row's sampler slot. int32: context lengths, the rows
    longest context first (the decode kernel's launch order), the cascade's suffix_lens and
    prefix_len (attention/cascade.py), then the block tables and the cascade's suffix tables:
    the wide ones last, so that what a graph of batch size bs reads ends at row bs of its
    tables (used_entries)."""
    return Layout.of(
        int64={"ids": n, "pos": n, "slots": n, "sources": n, "sampler_slots": n},
        int32={
            "ctx": n,
            "order": n,
            "suffix_lens": n,
            "prefix_len": 1,
            "tables": (n, width),
            "suffix_tables": (n, width),
        },
    )


def used_entries(n: int, width: int, bs: int, cascade: bool) -> int:
    """The int64 entries at the start of the buffer that hold everything the graph of batch
    size bs (with the cascade or not) reads: what a step copies, and broadcasts."""
    int32 = 3 * n + 1 + (n * width if cascade else 0) + bs * width
    return 5 * n + -(-int32 // 2)


class CUDAGraphRunner:
    """Replays the decode step (embedding through lm_head, then the sampler) for a batch
    padded to the next captured size.

    The graphs read one StepBuffer (graph_layout's), which each step fills on the host and
    sends in one asynchronous copy of the part its graph reads.
    """

    def __init__(
        self,
        max_num_seqs: int,
        kv: KVCache,
        sampler_scratch: int,
        logits: torch.Tensor | None = None,
    ) -> None:
        """logits: the engine's graph output buffer (graph_logits.py), max_num_seqs rows at
        least; None: one of its own at capture."""
        self.sizes = capture_sizes(max_num_seqs)
        self.kv = kv
        self.sampler_scratch = sampler_scratch  # the sampler slot padding rows use
        self.logits = logits
        # Keyed by (batch size, variant, filtering, cascade): variant i serves contexts up to
        # variants[i][0]; filtering is the sampler's FilterStage the graph runs (a batch of
        # top-p alone skips the thresholds: every decode batch size has a graph of each),
        # filtering None ones stop at the logits (structured output's masks and logit_bias
        # are applied to them after the replay, and the sampler runs eagerly then);
        # cascade graphs attend a prefix the whole batch shares once (attention/cascade.py).
        # Each holds (graph, logits, tokens).
        self.graphs: dict[
            tuple[int, int, FilterStage | None, bool],
            tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None],
        ] = {}
        self.meta: dict[tuple[int, int, FilterStage | None, bool], AttentionMetadata] = {}
        self.cascade_from: int | None = None
        self.pool = None  # the graphs' memory pool, once captured

    def _allocate(self, device: torch.device, max_model_len: int, variants) -> None:
        n = self.max_bs = self.sizes[-1]
        self.width = width = -(-max_model_len // self.kv.block_size)
        self.variants: list[tuple[int, int]] = variants
        self.buffer = StepBuffer(graph_layout(n, width), device)
        for h in self.buffer.host_fields:
            self._fill_padding(h, 0, n)
            # The capture warm-ups run on this; each step's prepare() sets its own order.
            # The decode kernel runs row order[i] as its i-th: a row the order leaves out
            # keeps whatever its output buffer held, and NaN logits would make the sampler
            # count a token past the vocabulary, into memory past its tables.
            h.order[:] = np.arange(n)
        self.buffer.send()  # both mirrors hold the padding: either may go first
        self.fields = self.buffer.fields
        self.ids, self.sampler_slots = self.fields.ids, self.fields.sampler_slots
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)

    def _fill_padding(self, h: SimpleNamespace, start: int, end: int) -> None:
        """Rows start:end become padding: they write to the scratch block and read only it."""
        scratch = self.kv.scratch_block
        h.ids[start:end] = 0
        h.sources[start:end] = 0
        h.pos[start:end] = 0
        h.slots[start:end] = scratch * self.kv.block_size
        h.ctx[start:end] = 1
        h.tables[start:end] = scratch
        h.suffix_tables[start:end] = scratch
        h.suffix_lens[start:end] = 1
        h.sampler_slots[start:end] = self.sampler_scratch

    def _static_meta(self, bs: int, variant: int, cascade: bool) -> AttentionMetadata:
        f = self.fields
        max_len, num_splits = self.variants[variant]
        width = -(-max_len // self.kv.block_size)
        meta = AttentionMetadata(
            is_prefill=False,
            positions=f.pos[:bs],
            slot_mapping=f.slots[:bs],
            context_lens=f.ctx[:bs],
            block_tables=f.tables[:bs, :width],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            max_seqlen_q=1,
            max_seqlen_k=max_len,
            num_splits=num_splits,
            decode_order=f.order[:bs],
        )
        if cascade:
            meta.suffix_lens = f.suffix_lens[:bs]
            meta.prefix_len = f.prefix_len
            meta.suffix_tables = f.suffix_tables[:bs, :width]
        return meta

    def inputs(self, key) -> torch.Tensor:
        """The start of the device buffer that holds everything the graph of key reads."""
        bs, _, _, cascade = key
        return self.buffer.dev[: used_entries(self.max_bs, self.width, bs, cascade)]

    @torch.inference_mode()
    def capture(
        self,
        runner,
        max_model_len: int,
        variants: list[tuple[int, int]],
        progress: bool = True,
        cascade_from: int | None = None,
        sampling: bool = True,
    ) -> None:
        """variants: the attention backend's graph_variants(max_model_len); cascade_from:
        its cascade_from (None: no cascade graphs); sampling False: logits-only graphs
        alone (a draft model's, spec/draft.py)."""
        self._allocate(runner.device, max_model_len, variants)
        self.cascade_from = cascade_from
        self.model, self.sampler = runner.model, runner.sampler
        if self.logits is None:
            self.logits = allocate_graph_logits(self.max_bs, runner.model)
        # Largest first: smaller graphs then fit inside the memory pool the largest reserved.
        # Logits-only graphs are captured at their first use (few engines ever need them).
        keys = [
            (bs, i, filtering, cascade)
            for bs in sorted(self.sizes, reverse=True)
            for i in range(len(variants))
            for filtering in (tuple(FilterStage) if sampling else (None,))
            for cascade in (False, True)
            if not cascade or (cascade_from is not None and bs >= cascade_from)
        ]
        for key in tqdm(keys, desc="Capturing CUDA graphs", disable=not progress, leave=False):
            self._capture(key)
        torch.cuda.synchronize()

    def _capture(self, key) -> None:
        bs, variant, filtering, cascade = key
        model, sampler = self.model, self.sampler
        if filtering is None:
            sampler = None
        meta = self._static_meta(bs, variant, cascade)
        slots = self.sampler_slots[:bs]
        # Warm-up: autotuning, lazy init, Triton compiles (padding rows sample in the
        # sampler's scratch slot). Other tensor-parallel ranks have no sampler. A graph
        # captured mid-run warms up on the step's own inputs, which only rewrites the KV
        # entries that its replay writes.
        logits = self._forward(model, key, meta)
        if sampler is not None:
            sampler(logits, slots, filtering)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog thread may query events while this captures.
        mode = "global" if model.tp is None else "thread_local"
        with capture(graph, self.pool, mode):
            logits = self._forward(model, key, meta)
            tokens = None
            if sampler is not None:
                tokens = sampler(logits, slots, filtering)
        self.pool = graph.pool()
        self.graphs[key] = (graph, logits, tokens)
        self.meta[key] = meta

    def _forward(self, model, key, meta: AttentionMetadata) -> torch.Tensor:
        """What a graph runs before the sampler: the model, and under tensor parallelism
        first the broadcast of rank 0's inputs into every rank's buffer."""
        if model.tp is not None:
            model.tp.broadcast(self.inputs(key))
        bs = key[0]
        return model.compute_logits(model(self.ids[:bs], meta), out=self.logits[:bs])

    def release(self) -> None:
        """Frees every graph and its memory pool; later steps run eagerly. NCCL cannot
        destroy or abort a communicator while a graph that captured its collectives lives
        (both hang): tensor-parallel ranks release their graphs first."""
        for graph, _, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def can_run(self, num_seqs: int, logits_only: bool = False) -> bool:
        """Logits-only graphs are captured mid-run on one GPU only: under tensor parallelism
        every rank would have to capture at the same step."""
        if logits_only and self.model.tp is not None:
            return False
        return num_seqs <= self.max_bs and bool(self.graphs)

    def padded_size(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    def key_for(
        self,
        num_seqs: int,
        max_context: int,
        filtering: FilterStage | None = FilterStage.NONE,
        cascade=False,
    ):
        """The graph serving this batch: (padded batch size, first variant long enough,
        filtering (None: logits only), cascade)."""
        variant = next(i for i, (limit, _) in enumerate(self.variants) if max_context <= limit)
        return self.padded_size(num_seqs), variant, filtering, cascade

    @torch.inference_mode()
    def prepare(
        self,
        seqs,
        ids: list[int],
        sources: list[int],
        sampler_slots: list[int],
        filtering: FilterStage | None,
    ) -> tuple[int, int, FilterStage | None, bool]:
        """Writes the decode inputs of seqs into the graphs' buffer and sends it; returns the
        key of the graph to replay. ids: each one's newest token (PLACEHOLDER if in flight),
        sources: the rows of the last step's tokens that hold those in flight (the runner
        fills them in on the device). Nothing here waits for the GPU."""
        n = len(seqs)
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=n)
        bs, variant, _, _ = key = self.key_for(n, int(lens.max()), filtering)
        block_size = self.kv.block_size
        # This mirror was last copied from two steps ago, and the engine has read that
        # step's tokens back since, so the copy is done and the mirror free to refill.
        h = self.buffer.host()
        h.ids[:n] = ids
        h.sources[:n] = sources
        h.sampler_slots[:n] = sampler_slots
        h.pos[:n] = lens - 1
        h.ctx[:n] = lens
        # Columns past a sequence's own blocks keep stale ids; every kernel stops reading at
        # the context length, so they are never used.
        for i, s in enumerate(seqs):
            h.tables[i, : len(s.block_table)] = s.block_table
        last_block = h.tables[np.arange(n), (lens - 1) // block_size]
        h.slots[:n] = last_block * block_size + (lens - 1) % block_size
        if self.cascade_from is not None and n >= self.cascade_from:
            shared = shared_prefix_blocks(h.tables[:n], lens, block_size)
            if shared:
                key = (bs, variant, filtering, True)
                h.prefix_len[0] = shared * block_size
                h.suffix_lens[:n] = lens - shared * block_size
                h.suffix_tables[:n, : self.width - shared] = h.tables[:n, shared:]
        self._fill_padding(h, n, bs)
        h.order[:bs] = np.argsort(-h.ctx[:bs], kind="stable")
        self.buffer.send(used_entries(self.max_bs, self.width, bs, key[3]))
        return key

    def replay(self, key) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replays the graph of key over what the static buffers hold now (capturing it
        first, for a logits-only graph not used before)."""
        if key not in self.graphs:
            self._capture(key)
        graph, logits, tokens = self.graphs[key]
        graph.replay()
        return logits, tokens
