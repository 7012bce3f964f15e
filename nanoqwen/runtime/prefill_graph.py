"""Prefill-shaped steps captured as CUDA graphs: a short prompt (the time to first token) and
mixed steps, where running sequences' next tokens share a step with prompt chunks (the
streams that keep decoding while a long prompt arrives in chunks).

Eagerly such a step is bound by the CPU: a few hundred kernel launches through torch's
dispatcher and Triton's launcher take 8-17 ms of CPU for 1-5 ms of GPU work (an H200), and
every stream in a mixed step waits that long for its token. One graph per token bucket
replays the model, lm_head and the sampler in one launch.

A step of n tokens from s sequences runs in the smallest bucket of T >= n rows. Rows [0, n)
are the sequences' rows in order; rows [n, T) are a padding sequence of T - n tokens whose
keys go to the KV cache's scratch block; the sequences after it, up to the bucket's capacity
(min(T, max_num_seqs) + 1), have no rows at all. So every row the graph computes is an
ordinary token of some sequence (no row reads uninitialised memory), and nothing it writes
reaches a real block. Logits come from one row (a lone prompt completing: the TTFT graph)
or from as many rows as the bucket can hold sequences (a mixed step); rows with no sequence
to sample for point at row 0 and sample into the sampler's scratch slot.

Under tensor parallelism every rank captures the same graphs. Rank 0 fills its buffer and
announces the key (runtime/parallel/runner.py); each graph's first kernel broadcasts rank 0's
buffer into the others', as the decode graphs do.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from tqdm import tqdm

from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.runtime.graph_capture import capture
from nanoqwen.runtime.graph_logits import allocate_graph_logits
from nanoqwen.runtime.kv.cache import KVCache
from nanoqwen.runtime.scheduler import Batch
from nanoqwen.runtime.step_buffer import Layout, StepBuffer
from nanoqwen.runtime.step_inputs import prompt_logprob_plan

# Above this many tokens the GPU's work outlasts the CPU's launches, and eager costs little.
MAX_BUCKET = 512


def buckets(max_tokens: int) -> list[int]:
    """Powers of two from 16 up to the first that holds max_tokens rows (MAX_BUCKET at
    most): a step of n tokens takes the smallest bucket of n rows or more."""
    sizes = [16]
    while sizes[-1] < min(max_tokens, MAX_BUCKET):
        sizes.append(2 * sizes[-1])
    return sizes


def prefill_layout(rows: int, seqs: int, width: int) -> Layout:
    """The graphs' buffer, for buckets of up to rows tokens and seqs sequences (the padding
    ones included). int64: ids, positions and KV slots per row, the row of the last step's
    tokens that holds an id still in flight, then the logit rows and their sampler slots;
    int32: cu_seqlens_q, cu_seqlens_k, context lengths, and the block tables last, so that
    what a bucket reads ends at its last table row (used_entries)."""
    return Layout.of(
        int64={
            "ids": rows,
            "pos": rows,
            "slots": rows,
            "sources": rows,
            "logit_rows": seqs - 1,
            "sampler_slots": seqs - 1,
        },
        int32={"cu_q": seqs + 1, "cu_k": seqs + 1, "ctx": seqs, "tables": (seqs, width)},
    )


class PrefillGraphRunner:
    """Replays prefill-shaped steps of up to MAX_BUCKET tokens (prompt chunks, and running
    sequences' tokens beside them) without prompt logprobs."""

    def __init__(
        self,
        max_tokens: int,
        max_num_seqs: int,
        kv: KVCache,
        sampler_scratch: int,
        logits: torch.Tensor | None = None,
    ) -> None:
        """logits: the engine's graph output buffer (graph_logits.py), max_num_seqs rows at
        least; None: one of its own at capture."""
        self.sizes = buckets(max_tokens)
        self.max_num_seqs = max_num_seqs
        self.kv = kv
        self.sampler_scratch = sampler_scratch
        self.logits = logits
        # (bucket, logit rows, filtering) -> (graph, logits, tokens)
        self.graphs: dict[tuple[int, int, bool], tuple] = {}
        self.meta: dict[int, AttentionMetadata] = {}

    def capacity(self, bucket: int) -> int:
        """Sequences a bucket holds, its padding sequence included."""
        return min(bucket, self.max_num_seqs) + 1

    def logit_rows(self, bucket: int) -> list[int]:
        """The logit row counts captured per bucket: one, and one per sequence it can hold."""
        return sorted({1, self.capacity(bucket) - 1})

    def _allocate(self, device: torch.device, max_model_len: int) -> None:
        rows = self.rows = self.sizes[-1]
        # Wide enough for the padding sequence too, which may be longer than max_model_len.
        self.width = width = -(-max(max_model_len, rows) // self.kv.block_size)
        self.max_model_len = max_model_len
        self.layout = prefill_layout(rows, self.capacity(rows), width)
        self.buffer = StepBuffer(self.layout, device)
        self.fields = self.buffer.fields

    def used_entries(self, bucket: int) -> int:
        """The int64 entries at the start of the buffer that hold all that bucket reads."""
        unused_tables = (self.capacity(self.rows) - self.capacity(bucket)) * self.width
        return self.layout.int64_entries + -(-(self.layout.int32_entries - unused_tables) // 2)

    def _fill(
        self,
        h: SimpleNamespace,
        batch: Batch,
        bucket: int,
        sources: list[int] | None,
        sampler_slots: list[int],
        num_logit_rows: int,
    ) -> None:
        """Lays batch out in bucket's rows: each sequence's chunk, then the padding sequence
        over the rows left, then sequences of no rows; the logit rows of the sequences that
        complete (sampler_slots: theirs, in order). sources: for each sequence, the row of
        the last step's tokens that holds its newest token when that one is in flight."""
        seqs, s = batch.seqs, len(batch.seqs)
        cap = self.capacity(bucket)
        bs, scratch = self.kv.block_size, self.kv.scratch_block
        counts = np.asarray(batch.num_new_tokens, dtype=np.int64)
        starts = np.fromiter((q.num_computed_tokens for q in seqs), dtype=np.int64, count=s)
        ends = starts + counts
        n = int(counts.sum())
        cu = np.zeros(s + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        # Columns past a sequence's own blocks keep stale ids, which no kernel reads (they
        # stop at the context length); the padding rows see the scratch block alone.
        for i, q in enumerate(seqs):
            h.tables[i, : len(q.block_table)] = q.block_table
        h.tables[s:cap] = scratch
        owner = np.repeat(np.arange(s), counts)
        pos = np.arange(n) - cu[owner] + starts[owner]
        h.pos[:n] = pos
        h.slots[:n] = h.tables[owner, pos // bs].astype(np.int64) * bs + pos % bs
        h.ids[:n] = [t for q, a, c in zip(seqs, starts.tolist(), batch.num_new_tokens)
                     for t in q.token_ids[a : a + c]]  # fmt: skip
        h.sources[:bucket] = 0
        if sources is not None:
            h.sources[cu[1:] - 1] = sources  # only a sequence's last row can be in flight
        pad = bucket - n
        h.ids[n:bucket] = 0
        h.pos[n:bucket] = np.arange(pad)
        # Padding keys overwrite one another in the scratch block: they are never read
        # by anything but the padding rows themselves.
        h.slots[n:bucket] = scratch * bs + np.arange(pad) % bs
        h.cu_q[: s + 1] = cu
        h.cu_q[s + 1 : cap + 1] = bucket
        h.cu_k[0] = 0
        np.cumsum(ends, out=h.cu_k[1 : s + 1])
        h.cu_k[s + 1 : cap + 1] = h.cu_k[s] + pad
        h.ctx[:s] = ends
        h.ctx[s] = pad
        h.ctx[s + 1 : cap] = 0
        done = [i for i in range(s) if batch.completes(i)]
        h.logit_rows[:num_logit_rows] = 0
        h.logit_rows[: len(done)] = cu[np.asarray(done, dtype=np.int64) + 1] - 1
        h.sampler_slots[:num_logit_rows] = self.sampler_scratch
        h.sampler_slots[: len(done)] = sampler_slots

    def _warm_up_inputs(self, bucket: int, num_logit_rows: int) -> None:
        """What the capture warm-ups of bucket run on: the padding sequence over all its rows.
        Each bucket needs its own: over the largest bucket's layout, a smaller bucket's
        kernels read and wrote the rows that layout names past the end of their tensors."""
        empty = Batch([], True, [])
        self._fill(self.buffer.host(), empty, bucket, None, [], num_logit_rows)
        self.buffer.send()

    def _static_meta(self, bucket: int) -> AttentionMetadata:
        f, cap = self.fields, self.capacity(bucket)
        return AttentionMetadata(
            is_prefill=True,
            positions=f.pos[:bucket],
            slot_mapping=f.slots[:bucket],
            context_lens=f.ctx[:cap],
            block_tables=f.tables[:cap],
            cu_seqlens_q=f.cu_q[: cap + 1],
            max_seqlen_q=bucket,
            max_seqlen_k=max(self.max_model_len, bucket),
            cu_seqlens_k=f.cu_k[: cap + 1],
            padded=True,
        )

    def setup(self, runner, max_model_len: int) -> None:
        """The buffers and each bucket's metadata, which every graph reads."""
        self.model, self.sampler = runner.model, runner.sampler
        self._allocate(runner.device, max_model_len)
        if self.logits is None:
            rows = self.capacity(self.rows) - 1
            self.logits = allocate_graph_logits(rows, runner.model)
        self.meta = {bucket: self._static_meta(bucket) for bucket in self.sizes}

    def keys(self) -> list[tuple[int, int, bool]]:
        """(bucket, logit rows, filtering) of every graph, largest first: smaller graphs then
        fit inside the memory pool the largest reserved."""
        return [(b, r, f) for b in sorted(self.sizes, reverse=True)
                for r in reversed(self.logit_rows(b)) for f in (False, True)]  # fmt: skip

    @torch.inference_mode()
    def capture(self, runner, max_model_len: int, pool=None, progress: bool = True) -> None:
        """pool: the decode graphs' memory pool, shared (no two graphs ever run at once).
        Tensor-parallel ranks other than 0 have no sampler: their graphs end at the logits.
        Every rank captures every key in the same order, so the warm-ups' collectives pair."""
        self.setup(runner, max_model_len)
        # thread_local: the NCCL watchdog thread may query events while this captures.
        mode = "global" if self.model.tp is None else "thread_local"
        keys = self.keys()
        for key in tqdm(keys, desc="Capturing prefill graphs", disable=not progress, leave=False):
            self._warm_up_inputs(key[0], key[1])
            self.forward(key)  # compiles, autotuning
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with capture(graph, pool, mode):
                logits, tokens = self.forward(key)
            pool = graph.pool()
            self.graphs[key] = (graph, logits, tokens)
        torch.cuda.synchronize()

    def forward(self, key: tuple[int, int, bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the graph of key runs, over the buffer as it is: the logits of its rows and,
        where there is a sampler (not on other tensor-parallel ranks), their tokens."""
        bucket, rows, filtering = key
        model, sampler = self.model, self.sampler
        if model.tp is not None:  # rank 0's inputs into every rank's buffer
            model.tp.broadcast(self.buffer.dev[: self.used_entries(bucket)])
        meta = self.meta[bucket]
        meta.shared.clear()  # what the first layer derives from this step's rows
        x, residual = model(self.fields.ids[:bucket], meta)
        at = self.fields.logit_rows[:rows]
        logits = model.compute_logits((x[at], residual[at]), out=self.logits[:rows])
        if sampler is None:
            return logits, None
        return logits, sampler(logits, self.fields.sampler_slots[:rows], filtering)

    def release(self) -> None:
        """Frees the graphs (CUDAGraphRunner.release says why tensor parallelism needs it)."""
        for graph, _, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def bucket(self, batch: Batch) -> int | None:
        """The bucket whose graphs can run batch, or None (too many tokens or sequences,
        or prompt logprobs to compute)."""
        n = sum(batch.num_new_tokens)
        if not self.graphs or not batch.is_prefill or n > self.sizes[-1]:
            return None
        bucket = next(b for b in self.sizes if b >= n)
        if len(batch.seqs) >= self.capacity(bucket) or prompt_logprob_plan(batch):
            return None
        return bucket

    def can_run(self, batch: Batch) -> bool:
        return self.bucket(batch) is not None

    @torch.inference_mode()
    def prepare(
        self,
        batch: Batch,
        bucket: int,
        sources: list[int] | None,
        sampler_slots: list[int],
        filtering: int,
    ) -> tuple[int, int, bool]:
        """Writes batch into the graphs' buffer, in bucket (bucket(batch)'s answer), and
        sends it; returns the key of the graph to replay. sampler_slots: those of the
        sequences that complete, in order; sources: see _fill (None when no id is in
        flight). Nothing here waits for the GPU."""
        rows = 1 if len(sampler_slots) <= 1 else self.capacity(bucket) - 1
        self._fill(self.buffer.host(), batch, bucket, sources, sampler_slots, rows)
        self.buffer.send(self.used_entries(bucket))
        return bucket, rows, bool(filtering)  # FULL's graph samples a NUCLEUS batch too

    def replay(self, key: tuple[int, int, bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replays the graph of key; returns its [rows, vocab] logits and [rows] tokens (None
        on tensor-parallel ranks other than 0), the graph's own output buffers."""
        graph, logits, tokens = self.graphs[key]
        graph.replay()
        return logits, tokens
