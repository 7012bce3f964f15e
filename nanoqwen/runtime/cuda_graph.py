"""Decode steps captured as CUDA graphs: one replay instead of hundreds of kernel launches."""

from __future__ import annotations

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
    captured size. Inputs live in static buffers that each replay reads."""

    def __init__(self, max_num_seqs: int, kv: KVCache) -> None:
        self.sizes = capture_sizes(max_num_seqs)
        self.kv = kv
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.meta: dict[int, AttentionMetadata] = {}

    def _allocate(self, device: torch.device, max_model_len: int) -> None:
        n = self.sizes[-1]
        width = -(-max_model_len // self.kv.block_size)
        scratch = self.kv.scratch_block

        def full(shape, value, dtype):
            return torch.full(shape, value, dtype=dtype, device=device)

        self.buffers = {
            "ids": full((n,), 0, torch.int64),
            "positions": full((n,), 0, torch.int64),
            "slot_mapping": full((n,), scratch * self.kv.block_size, torch.int64),
            "context_lens": full((n,), 1, torch.int32),
            "cache_seqlens": full((n,), 0, torch.int32),
            "block_tables": full((n, width), scratch, torch.int32),
            "cu_seqlens_q": torch.arange(n + 1, dtype=torch.int32, device=device),
        }
        self.max_model_len = max_model_len

    def _static_meta(self, bs: int) -> AttentionMetadata:
        b = self.buffers
        return AttentionMetadata(
            is_prefill=False,
            positions=b["positions"][:bs],
            slot_mapping=b["slot_mapping"][:bs],
            context_lens=b["context_lens"][:bs],
            block_tables=b["block_tables"][:bs],
            cu_seqlens_q=b["cu_seqlens_q"][: bs + 1],
            max_seqlen_q=1,
            max_seqlen_k=self.max_model_len,
            cache_seqlens=b["cache_seqlens"][:bs],
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
            ids = self.buffers["ids"][:bs]
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
        return num_seqs <= self.sizes[-1]

    def padded_size(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    def run(self, runner, batch) -> torch.Tensor:
        bs = self.padded_size(len(batch.seqs))
        ids, meta = runner.prepare_decode(batch, bs)
        b = self.buffers
        b["ids"][:bs].copy_(ids, non_blocking=True)
        for name in ("positions", "slot_mapping", "context_lens", "cache_seqlens"):
            b[name][:bs].copy_(getattr(meta, name), non_blocking=True)
        # Columns past this batch's widest table keep old ids; no kernel reads them, because
        # every read stops at the sequence's context length (and padding rows use column 0).
        width = meta.block_tables.shape[1]
        b["block_tables"][:bs, :width].copy_(meta.block_tables, non_blocking=True)
        graph, logits = self.graphs[bs]
        graph.replay()
        return logits
