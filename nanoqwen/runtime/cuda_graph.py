"""Decode steps captured as CUDA graphs: one replay instead of hundreds of kernel launches."""

from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from nanoqwen.model.attention import AttentionMetadata
from nanoqwen.runtime.attention.cascade import shared_prefix_blocks
from nanoqwen.runtime.kv.cache import KVCache


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class _HostMirror:
    """Pinned host copies of the graphs' input buffers, with numpy views to fill them.

    int64 part: ids, positions, slot_mapping, for a token still in flight the row of the
    previous step's output that holds it, and each row's sampler slot. int32 part:
    context_lens, tables, then the cascade's suffix_lens, prefix_len and
    suffix_tables (attention/cascade.py), then the rows longest context first (the decode
    kernel's launch order). Both parts live in one buffer (t), so a step's
    inputs are one copy, and with tensor parallelism one broadcast.
    """

    def __init__(self, n: int, width: int) -> None:
        self.t = torch.zeros(5 * n + -(-int32_entries(n, width) // 2), dtype=torch.int64)
        if torch.cuda.is_available():  # the layout's tests run without a GPU
            self.t = self.t.pin_memory()
        self.t64, self.t32 = self.t[: 5 * n], self.t[5 * n :].view(torch.int32)
        h64, h32 = self.t64.numpy(), self.t32.numpy()
        self.ids, self.pos, self.slots = h64[:n], h64[n : 2 * n], h64[2 * n : 3 * n]
        self.sources, self.sampler_slots = h64[3 * n : 4 * n], h64[4 * n :]
        self.ctx = h32[:n]
        end = n + n * width
        self.tables = h32[n:end].reshape(n, width)
        self.suffix_lens, self.prefix_len = h32[end : end + n], h32[end + n : end + n + 1]
        self.suffix_tables = h32[end + n + 1 : end + n + 1 + n * width].reshape(n, width)
        self.order = h32[end + n + 1 + n * width : end + 2 * n + 1 + n * width]


def int32_entries(n: int, width: int) -> int:
    """context_lens, tables, suffix_lens, prefix_len, suffix_tables, order."""
    return 3 * n + 1 + 2 * n * width


class CUDAGraphRunner:
    """Replays the decode step (embedding through lm_head, then the sampler) for a batch
    padded to the next captured size.

    The graphs read static device buffers. Each step fills pinned host mirrors of them with
    numpy and sends them in two asynchronous copies (one per dtype), so preparing a step
    costs no allocation and no per-tensor launch. Two mirrors take turns: while step N's
    copy may still be queued behind step N-1, step N+1 fills the other one.
    """

    def __init__(self, max_num_seqs: int, kv: KVCache, sampler_scratch: int) -> None:
        self.sizes = capture_sizes(max_num_seqs)
        self.kv = kv
        self.sampler_scratch = sampler_scratch  # the sampler slot padding rows use
        # Keyed by (batch size, variant, filtering, cascade): variant i serves contexts up to
        # variants[i][0]; filtering graphs include the sampler's top-k/top-p/min-p stage;
        # cascade graphs attend a prefix the whole batch shares once (attention/cascade.py).
        # Each holds (graph, logits, tokens).
        self.graphs: dict[
            tuple[int, int, bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]
        ] = {}
        self.meta: dict[tuple[int, int, bool, bool], AttentionMetadata] = {}
        self.cascade_from: int | None = None

    def _allocate(self, device: torch.device, max_model_len: int, variants) -> None:
        n = self.max_bs = self.sizes[-1]
        self.width = width = -(-max_model_len // self.kv.block_size)
        self.variants: list[tuple[int, int]] = variants
        self.mirrors = [_HostMirror(n, width) for _ in range(2)]
        for m in self.mirrors:
            self._fill_padding(m, 0, n)
            # The capture warm-ups run on this; each step's prepare() sets its own order.
            # The decode kernel runs row order[i] as its i-th: a row the order leaves out
            # keeps whatever its output buffer held, and NaN logits there once made the
            # sampler count a token past the vocabulary, into memory past its tables.
            m.order[:] = np.arange(n)
        self.turn = 0
        self.dev = self.mirrors[0].t.to(device)  # what the graphs read; its layout is t's
        self.dev64, self.dev32 = self.dev[: 5 * n], self.dev[5 * n :].view(torch.int32)
        self.ids = self.dev64[:n]
        self.sampler_slots = self.dev64[4 * n :]
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)

    def _fill_padding(self, m: _HostMirror, start: int, end: int) -> None:
        """Rows start:end become padding: they write to the scratch block and read only it."""
        scratch = self.kv.scratch_block
        m.ids[start:end] = 0
        m.sources[start:end] = 0
        m.pos[start:end] = 0
        m.slots[start:end] = scratch * self.kv.block_size
        m.ctx[start:end] = 1
        m.tables[start:end] = scratch
        m.suffix_tables[start:end] = scratch
        m.suffix_lens[start:end] = 1
        m.sampler_slots[start:end] = self.sampler_scratch

    def _static_meta(self, bs: int, variant: int, cascade: bool) -> AttentionMetadata:
        n, d64, d32, w = self.max_bs, self.dev64, self.dev32, self.width
        max_len, num_splits = self.variants[variant]
        width = -(-max_len // self.kv.block_size)
        end = n + n * w
        meta = AttentionMetadata(
            is_prefill=False,
            positions=d64[n : n + bs],
            slot_mapping=d64[2 * n : 2 * n + bs],
            context_lens=d32[:bs],
            block_tables=d32[n:end].view(n, w)[:bs, :width],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            max_seqlen_q=1,
            max_seqlen_k=max_len,
            num_splits=num_splits,
            decode_order=d32[end + n + 1 + n * w :][:bs],
        )
        if cascade:
            meta.suffix_lens = d32[end : end + bs]
            meta.prefix_len = d32[end + n : end + n + 1]
            meta.suffix_tables = d32[end + n + 1 : end + n + 1 + n * w].view(n, w)[:bs, :width]
        return meta

    @torch.inference_mode()
    def capture(
        self,
        runner,
        max_model_len: int,
        variants: list[tuple[int, int]],
        progress: bool = True,
        cascade_from: int | None = None,
    ) -> None:
        """variants: the attention backend's graph_variants(max_model_len); cascade_from:
        its cascade_from (None: no cascade graphs)."""
        model = runner.model
        self._allocate(runner.device, max_model_len, variants)
        self.cascade_from = cascade_from
        pool = None
        # Largest first: smaller graphs then fit inside the memory pool the largest reserved.
        keys = [
            (bs, i, filtering, cascade)
            for bs in sorted(self.sizes, reverse=True)
            for i in range(len(variants))
            for filtering in (False, True)
            for cascade in (False, True)
            if not cascade or (cascade_from is not None and bs >= cascade_from)
        ]
        for key in tqdm(keys, desc="Capturing CUDA graphs", disable=not progress, leave=False):
            bs, variant, filtering, cascade = key
            meta = self._static_meta(bs, variant, cascade)
            ids, slots = self.ids[:bs], self.sampler_slots[:bs]
            # Warm-up: autotuning, lazy init, Triton compiles (padding rows sample in the
            # sampler's scratch slot). Other tensor-parallel ranks have no sampler.
            logits = model.compute_logits(model(ids, meta))
            if runner.sampler is not None:
                runner.sampler(logits, slots, filtering)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the NCCL watchdog thread may query events while this captures.
            mode = "global" if model.tp is None else "thread_local"
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                logits = model.compute_logits(model(ids, meta))
                tokens = None
                if runner.sampler is not None:
                    tokens = runner.sampler(logits, slots, filtering)
            pool = graph.pool()
            self.graphs[key] = (graph, logits, tokens)
            self.meta[key] = meta
        torch.cuda.synchronize()

    def release(self) -> None:
        """Frees every graph and its memory pool; later steps run eagerly. NCCL cannot
        destroy or abort a communicator while a graph that captured its collectives lives
        (both hung on two H200s): tensor-parallel ranks release their graphs first."""
        for graph, _, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_bs and bool(self.graphs)

    def padded_size(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    def key_for(
        self, num_seqs: int, max_context: int, filtering: bool = False, cascade: bool = False
    ):
        """The graph serving this batch: (padded batch size, first variant long enough,
        filtering, cascade)."""
        variant = next(i for i, (limit, _) in enumerate(self.variants) if max_context <= limit)
        return self.padded_size(num_seqs), variant, filtering, cascade

    @torch.inference_mode()
    def prepare(self, runner, seqs, filtering: bool = False) -> tuple[int, int, bool, bool]:
        """Writes the decode inputs of seqs into the static buffers; returns the key of the
        graph to replay.
        Only host arithmetic and async device work: nothing here waits for the GPU."""
        n = len(seqs)
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=n)
        bs, variant, _, _ = key = self.key_for(n, int(lens.max()), filtering)
        block_size = self.kv.block_size
        ids, sources, pending = runner.token_sources(seqs)
        # This mirror was last copied from two steps ago, and the engine has read that
        # step's tokens back since, so the copy is done and the mirror free to refill.
        m = self.mirrors[self.turn]
        self.turn ^= 1
        m.ids[:n] = ids
        m.sources[:n] = sources
        m.sampler_slots[:n] = runner.sampler.slots(seqs)
        m.pos[:n] = lens - 1
        m.ctx[:n] = lens
        # Columns past a sequence's own blocks keep stale ids; every kernel stops reading at
        # the context length, so they are never used.
        for i, s in enumerate(seqs):
            m.tables[i, : len(s.block_table)] = s.block_table
        last_block = m.tables[np.arange(n), (lens - 1) // block_size]
        m.slots[:n] = last_block * block_size + (lens - 1) % block_size
        if self.cascade_from is not None and n >= self.cascade_from:
            shared = shared_prefix_blocks(m.tables[:n], lens, block_size)
            if shared:
                key = (bs, variant, filtering, True)
                m.prefix_len[0] = shared * block_size
                m.suffix_lens[:n] = lens - shared * block_size
                m.suffix_tables[:n, : self.width - shared] = m.tables[:n, shared:]
        self._fill_padding(m, n, bs)
        m.order[:bs] = np.argsort(-m.ctx[:bs], kind="stable")
        self.dev.copy_(m.t, non_blocking=True)
        if pending:
            ids, rows = self.dev64[:n], self.dev64[3 * self.max_bs :][:n]
            ids.copy_(runner.fill_placeholders(ids, rows))
        return key

    @torch.inference_mode()
    def run(self, runner, seqs, filtering: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Replays the step; returns the (padded) logits and sampled tokens."""
        return self.replay(self.prepare(runner, seqs, filtering))

    def replay(self, key) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replays the graph of key over what the static buffers hold now."""
        graph, logits, tokens = self.graphs[key]
        graph.replay()
        return logits, tokens
