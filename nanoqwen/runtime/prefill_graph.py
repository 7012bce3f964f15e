"""Short prefills of one sequence captured as CUDA graphs, for the time to first token.

Eagerly, a prefill of a few hundred tokens is bound by the CPU: some 200 kernel launches
through torch's dispatcher take 8-12 ms of CPU for 1-5 ms of GPU work (on an H200), and
that is most of a short request's time to first token. One graph per token bucket replays
the model, lm_head and the sampler in one launch.

A chunk of L new tokens runs in the smallest bucket of T > L rows. Rows [0, L) are the
sequence's; rows [L, T) are a second sequence of T - L padding tokens whose keys go to the
KV cache's scratch block, so every row the graph computes is an ordinary token of some
sequence (no row reads uninitialised memory) and nothing it writes reaches a real block.

Under tensor parallelism every rank captures the same graphs. Rank 0 fills its buffer and
announces the key (runtime/parallel/runner.py); each graph's first kernel broadcasts rank 0's
buffer into the others', as the decode graphs do.
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.runtime.kv.cache import KVCache
from nanoqwen.runtime.scheduler import Batch
from nanoqwen.runtime.step_buffer import Layout, StepBuffer

# Above this many tokens the GPU's work outlasts the CPU's launches, and eager costs little.
MAX_BUCKET = 512


def buckets(max_tokens: int) -> list[int]:
    """Powers of two from 16 while a chunk of max_tokens (or fewer) needs them: a chunk of
    L tokens takes the smallest bucket above L."""
    sizes = []
    size = 16
    while size <= MAX_BUCKET:
        sizes.append(size)
        if size > max_tokens:
            break
        size *= 2
    return sizes


def prefill_layout(rows: int, width: int) -> Layout:
    """The prefill graphs' buffer. int64: ids, positions, KV slots per row, then the logit
    row and the sampler slot; int32: cu_seqlens_q, cu_seqlens_k, context_lens (sequence and
    padding), the two block tables."""
    return Layout.of(
        int64={"ids": rows, "pos": rows, "slots": rows, "logit_row": 1, "sampler_slot": 1},
        int32={"cu_q": 3, "cu_k": 3, "ctx": 2, "tables": (2, width)},
    )


class PrefillGraphRunner:
    """Replays the prefill step of one sequence whose chunk is shorter than MAX_BUCKET
    tokens and completes its prompt (so it samples), without prompt logprobs."""

    def __init__(self, max_tokens: int, kv: KVCache, sampler_scratch: int) -> None:
        self.sizes = buckets(max_tokens)
        self.kv = kv
        self.sampler_scratch = sampler_scratch
        # (bucket, filtering) -> (graph, logits, tokens)
        self.graphs: dict[tuple[int, bool], tuple] = {}
        self.meta: dict[int, AttentionMetadata] = {}

    def _allocate(self, device: torch.device, max_model_len: int) -> None:
        rows = self.rows = self.sizes[-1]
        # Wide enough for the padding sequence too, which may be longer than max_model_len.
        self.width = width = -(-max(max_model_len, rows) // self.kv.block_size)
        self.max_model_len = max_model_len
        self.buffer = StepBuffer(prefill_layout(rows, width), device)
        self.fields = self.buffer.fields

    def _warm_up_inputs(self, bucket: int) -> None:
        """What the capture warm-ups of bucket run on: one token whose key goes to the
        scratch block, and the padding sequence up to the bucket's last row. Each bucket
        needs its own: over the largest bucket's layout, a smaller bucket's kernels read and
        wrote the rows that layout names past the end of their tensors."""
        scratch = np.full(self.width, self.kv.scratch_block, np.int32)
        self._fill(self.buffer.host(), [0], scratch, 0, 1, self.sampler_scratch, bucket)
        self.buffer.send()

    def _fill(self, h, ids, table, start: int, end: int, sampler_slot: int, bucket: int) -> None:
        """Rows [0, L) hold positions start..end-1 of a sequence whose block table is table;
        rows [L, bucket) the padding sequence."""
        n, pad = end - start, bucket - (end - start)
        bs, scratch = self.kv.block_size, self.kv.scratch_block
        pos = np.arange(start, end)
        h.ids[:n] = ids
        h.pos[:n] = pos
        h.slots[:n] = table[pos // bs].astype(np.int64) * bs + pos % bs
        h.ids[n:bucket] = 0
        h.pos[n:bucket] = np.arange(pad)
        # Padding keys overwrite one another in the scratch block: they are never read
        # by anything but the padding rows themselves.
        h.slots[n:bucket] = scratch * bs + np.arange(pad) % bs
        h.logit_row[0] = n - 1
        h.sampler_slot[0] = sampler_slot
        h.cu_q[:] = (0, n, bucket)
        h.cu_k[:] = (0, end, end + pad)
        h.ctx[:] = (end, pad)
        h.tables[0, : len(table)] = table
        h.tables[1] = scratch

    def _static_meta(self, bucket: int) -> AttentionMetadata:
        f = self.fields
        return AttentionMetadata(
            is_prefill=True,
            positions=f.pos[:bucket],
            slot_mapping=f.slots[:bucket],
            context_lens=f.ctx,
            block_tables=f.tables,
            cu_seqlens_q=f.cu_q,
            max_seqlen_q=bucket,
            max_seqlen_k=max(self.max_model_len, bucket),
            cu_seqlens_k=f.cu_k,
            padded=True,
        )

    @torch.inference_mode()
    def capture(self, runner, max_model_len: int, pool=None, progress: bool = True) -> None:
        """pool: the decode graphs' memory pool, shared (no two graphs ever run at once).
        Tensor-parallel ranks other than 0 have no sampler: their graphs end at the logits.
        Every rank captures every key in the same order, so the warm-ups' collectives pair."""
        self._allocate(runner.device, max_model_len)
        model, sampler = runner.model, runner.sampler
        # thread_local: the NCCL watchdog thread may query events while this captures.
        mode = "global" if model.tp is None else "thread_local"
        keys = [(b, f) for b in sorted(self.sizes, reverse=True) for f in (False, True)]
        for key in tqdm(keys, desc="Capturing prefill graphs", disable=not progress, leave=False):
            bucket, filtering = key
            if bucket not in self.meta:
                self.meta[bucket] = self._static_meta(bucket)
            meta = self.meta[bucket]
            self._warm_up_inputs(bucket)
            slot = self.fields.sampler_slot
            logits = self._forward(model, bucket, meta)
            if sampler is not None:
                sampler(logits, slot, filtering)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                logits = self._forward(model, bucket, meta)
                tokens = sampler(logits, slot, filtering) if sampler is not None else None
            pool = graph.pool()
            self.graphs[key] = (graph, logits, tokens)
        torch.cuda.synchronize()

    def _forward(self, model, bucket: int, meta: AttentionMetadata) -> torch.Tensor:
        if model.tp is not None:  # rank 0's inputs into every rank's buffer
            model.tp.broadcast(self.buffer.dev)
        x, residual = model(self.fields.ids[:bucket], meta)
        rows = self.fields.logit_row
        return model.compute_logits((x[rows], residual[rows]))

    def release(self) -> None:
        """Frees the graphs (CUDAGraphRunner.release says why tensor parallelism needs it)."""
        for graph, _, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def can_run(self, batch: Batch) -> bool:
        if not self.graphs or len(batch.seqs) != 1 or not batch.completes(0):
            return False
        seq = batch.seqs[0]
        return batch.num_new_tokens[0] < self.rows and seq.params.prompt_logprobs is None

    @torch.inference_mode()
    def prepare(self, batch: Batch, sampler_slot: int, filtering: bool) -> tuple[int, bool]:
        """Writes the step of batch (can_run's kind), whose sequence samples in sampler_slot,
        into the graphs' buffer and sends it; returns the key of the graph to replay.
        Nothing here waits for the GPU."""
        seq, n = batch.seqs[0], batch.num_new_tokens[0]
        start = seq.num_computed_tokens
        bucket = next(b for b in self.sizes if b > n)
        table = np.asarray(seq.block_table, dtype=np.int32)
        ids = seq.token_ids[start : start + n]
        self._fill(self.buffer.host(), ids, table, start, start + n, sampler_slot, bucket)
        self.buffer.send()
        return bucket, filtering

    def replay(self, key: tuple[int, bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replays the graph of key; returns its [1, vocab] logits and [1] tokens (None on
        tensor-parallel ranks other than 0), the graph's own output buffers."""
        graph, logits, tokens = self.graphs[key]
        graph.replay()
        return logits, tokens
