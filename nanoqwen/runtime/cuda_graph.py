"""Decode steps captured as CUDA graphs: one replay instead of hundreds of kernel launches."""

from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from nanoqwen.runtime.attention.base import AttentionMetadata
from nanoqwen.runtime.kv_cache import KVCache


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class CUDAGraphRunner:
    """Replays the decode step (embedding through lm_head) for a batch padded to the next
    captured size.

    The graphs read static device buffers. Each step fills pinned host mirrors of them with
    numpy and sends them in two asynchronous copies (one per dtype), so preparing a step
    costs no allocation and no per-tensor launch.
    """

    def __init__(self, max_num_seqs: int, kv: KVCache) -> None:
        self.sizes = capture_sizes(max_num_seqs)
        self.kv = kv
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.meta: dict[int, AttentionMetadata] = {}

    def _allocate(self, device: torch.device, max_model_len: int) -> None:
        n = self.max_bs = self.sizes[-1]
        self.width = width = -(-max_model_len // self.kv.block_size)
        self.max_model_len = max_model_len
        # int64 rows: ids, positions, slot_mapping. int32: context_lens, cache_seqlens, tables.
        self.host64 = torch.zeros(3 * n, dtype=torch.int64, pin_memory=True)
        self.host32 = torch.zeros(2 * n + n * width, dtype=torch.int32, pin_memory=True)
        self.dev64 = self.host64.to(device)
        self.dev32 = self.host32.to(device)
        h64, h32 = self.host64.numpy(), self.host32.numpy()
        self.h_ids, self.h_pos, self.h_slots = h64[:n], h64[n : 2 * n], h64[2 * n :]
        self.h_ctx, self.h_cached = h32[:n], h32[n : 2 * n]
        self.h_tables = h32[2 * n :].reshape(n, width)
        self._fill_padding(0, n)
        self.dev64.copy_(self.host64)
        self.dev32.copy_(self.host32)
        self.ids = self.dev64[:n]
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)

    def _fill_padding(self, start: int, end: int) -> None:
        """Rows start:end become padding: they write to the scratch block and read only it."""
        scratch = self.kv.scratch_block
        self.h_ids[start:end] = 0
        self.h_pos[start:end] = 0
        self.h_slots[start:end] = scratch * self.kv.block_size
        self.h_ctx[start:end] = 1
        self.h_cached[start:end] = 0
        self.h_tables[start:end] = scratch

    def _static_meta(self, bs: int) -> AttentionMetadata:
        n, d64, d32 = self.max_bs, self.dev64, self.dev32
        return AttentionMetadata(
            is_prefill=False,
            positions=d64[n : n + bs],
            slot_mapping=d64[2 * n : 2 * n + bs],
            context_lens=d32[:bs],
            block_tables=d32[2 * n :].view(n, self.width)[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            max_seqlen_q=1,
            max_seqlen_k=self.max_model_len,
            cache_seqlens=d32[n : n + bs],
        )

    @torch.inference_mode()
    def capture(self, runner, max_model_len: int, progress: bool = True) -> None:
        model = runner.model
        self._allocate(runner.device, max_model_len)
        pool = None
        # Largest first: smaller graphs then fit inside the memory pool the largest reserved.
        sizes = sorted(self.sizes, reverse=True)
        for bs in tqdm(sizes, desc="Capturing CUDA graphs", disable=not progress, leave=False):
            meta = self._static_meta(bs)
            ids = self.ids[:bs]
            model.compute_logits(model(ids, meta))  # warm-up: autotuning, lazy init
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = model.compute_logits(model(ids, meta))
            pool = graph.pool()
            self.graphs[bs] = (graph, logits)
            self.meta[bs] = meta
        torch.cuda.synchronize()

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_bs

    def padded_size(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    @torch.inference_mode()
    def prepare(self, seqs) -> int:
        """Writes the decode inputs of seqs into the static buffers; returns the graph size.
        Only host arithmetic and two async copies: nothing here waits for the GPU."""
        n = len(seqs)
        bs = self.padded_size(n)
        block_size = self.kv.block_size
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=n)
        self.h_ids[:n] = [s.token_ids[-1] for s in seqs]
        self.h_pos[:n] = lens - 1
        self.h_ctx[:n] = lens
        self.h_cached[:n] = lens - 1
        tables = self.h_tables
        # Columns past a sequence's own blocks keep stale ids; every kernel stops reading at
        # the context length, so they are never used.
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
        last_block = tables[np.arange(n), (lens - 1) // block_size]
        self.h_slots[:n] = last_block * block_size + (lens - 1) % block_size
        self._fill_padding(n, bs)
        # The previous step's copies have completed: its sampled tokens were read back.
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        return bs

    @torch.inference_mode()
    def run(self, seqs) -> torch.Tensor:
        bs = self.prepare(seqs)
        graph, logits = self.graphs[bs]
        graph.replay()
        return logits
