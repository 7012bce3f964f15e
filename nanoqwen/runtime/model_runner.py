"""Turns a scheduled batch into device tensors, runs the model, and samples the next tokens.

Steps are launched without waiting for their result (LaunchedStep), so the engine can
schedule and launch step N+1 while the GPU still runs step N. A token not yet read back
sits in its sequence as PLACEHOLDER; the next decode step takes it straight from the
device tensor that step N sampled into. A step's inputs reach the device as one StepBuffer
(step_buffer.py): laid out by step_inputs.py for an eager step, by the graph runners for a
replay; the runner hands each graph what it fills its buffer with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.model.qwen2 import Qwen2ForCausalLM
from nanoqwen.quant.linear import decode_arithmetic
from nanoqwen.runtime.kv.block_manager import BlockManager
from nanoqwen.runtime.kv.cache import KVCache
from nanoqwen.runtime.launched_step import PLACEHOLDER, LaunchedStep, rows_in_place
from nanoqwen.runtime.sampling.filter_stage import FilterStage
from nanoqwen.runtime.sampling.logit_bias import biased_logits
from nanoqwen.runtime.sampling.sampler import Sampler
from nanoqwen.runtime.sampling.structured import TokenMasks, masked_logits
from nanoqwen.runtime.sampling_params import SamplingParams
from nanoqwen.runtime.scheduler import Batch
from nanoqwen.runtime.sequence import Sequence
from nanoqwen.runtime.spec.verify import Verified, conclude, verify_rows
from nanoqwen.runtime.step_buffer import StepBuffer
from nanoqwen.runtime.step_inputs import (
    StepInputBuilder,
    StepInputs,
    prompt_logprob_plan,
    step_metadata,
)


@dataclass
class StepOutput:
    seqs: list[Sequence]  # those that sample a token this step
    logits: torch.Tensor  # their raw logits
    tokens: torch.Tensor | None  # None when none samples (a prefill chunk mid-prompt)
    prompt_logprobs: list
    # A step with structured output samples later (sample()): its masks need the tokens of
    # the step before, which the engine reads back while this step's model runs.
    filtering: FilterStage = FilterStage.NONE
    sample_later: bool = False
    slots: list[int] | None = None  # the sampler slots of seqs, taken while all are running


class ModelRunner:
    def __init__(
        self,
        model: Qwen2ForCausalLM,
        kv_cache: KVCache,
        block_manager: BlockManager,
        sampler: Sampler,
        graphs=None,
        prefill_graphs=None,
        verify_graphs=None,
    ) -> None:
        self.model = model
        self.kv = kv_cache
        self.blocks = block_manager
        self.inputs = StepInputBuilder(block_manager, kv_cache)
        self.sampler = sampler
        self.graphs = graphs  # CUDAGraphRunner for decode, or None for eager
        self.prefill_graphs = prefill_graphs  # PrefillGraphRunner, or None
        self.verify_graphs = verify_graphs  # spec/verify_graph.py's, or None
        self.device = model.embed_tokens.device
        self._pin = self.device.type == "cuda"
        model.bind_kv_cache(kv_cache.k, kv_cache.v)
        # The last launched step's tokens and each sequence's row in them.
        self._last_tokens = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._last_rows: dict[int, int] = {}
        self._masks: TokenMasks | None = None  # at the first step with structured output

    def token_sources(self, seqs: list[Sequence]) -> tuple[list[int], list[int], bool]:
        """Each sequence's newest token id (PLACEHOLDER if not read back yet), the row of
        the last launched step that holds it, and whether any is a placeholder."""
        ids = [s.token_ids[-1] for s in seqs]
        rows = [self._last_rows.get(s.seq_id, 0) for s in seqs]
        return ids, rows, PLACEHOLDER in ids

    def fill_placeholders(
        self, ids: torch.Tensor, rows: torch.Tensor, host: tuple[list[int], list[int]] | None
    ) -> None:
        """Each PLACEHOLDER in ids (on the device) becomes, in place, the token in its row
        (rows) of the last launched step's output. host: ids and rows as the host wrote them,
        when it has them: a batch decoding on in the same order then takes one device copy,
        where the general case takes a compare, a gather, a select and a copy."""
        m = rows_in_place(*host) if host is not None else 0
        if m:
            ids[:m].copy_(self._last_tokens[:m])
        else:
            ids.copy_(torch.where(ids == PLACEHOLDER, self._last_tokens[rows], ids))

    def _tensor(self, data, dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self._pin)
        return t.to(self.device, non_blocking=True)

    def decode_inputs(self, batch: Batch, rows: int) -> StepInputs:
        """rows >= len(batch.seqs): extra rows are padding that writes to the scratch block."""
        ids, sources, pending = self.token_sources(batch.seqs)
        return self.inputs.decode(batch, rows, ids, sources if pending else None)

    def upload(
        self, inputs: StepInputs
    ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor | None]:
        """The step's device tensors, (ids, metadata, prefill logit rows): views of one
        StepBuffer, sent in one copy."""
        buffer = StepBuffer(inputs.layout(), self.device, mirrors=1)
        inputs.write(buffer.host())
        buffer.send()
        self._sent(buffer, inputs)
        f = buffer.fields
        meta = step_metadata(f, inputs.is_prefill, inputs.max_seqlen_q, inputs.max_seqlen_k)
        return f.ids, meta, f.logit_rows if inputs.is_prefill else None

    def _sent(self, buffer: StepBuffer, inputs: StepInputs) -> None:
        """The step's buffer is on the device: its placeholder ids are filled in place (the
        other tensor-parallel ranks, which have no sampled tokens, get them filled)."""
        if inputs.sources is not None:
            f = buffer.fields
            self.fill_placeholders(f.ids, f.sources, (inputs.ids, inputs.sources))

    def prepare_prefill(self, batch: Batch) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        inputs = self.inputs.prefill(batch)
        if PLACEHOLDER in inputs.ids:
            # A running sequence decoding in this step: its newest token may be in flight.
            inputs.sources = [0] * len(inputs.ids)
            _, rows, _ = self.token_sources(batch.seqs)
            for row, end in zip(rows, inputs.cu_seqlens_q[1:]):
                if inputs.ids[end - 1] == PLACEHOLDER:
                    inputs.sources[end - 1] = row
        return self.upload(inputs)

    def prepare_decode(self, batch: Batch, rows: int) -> tuple[torch.Tensor, AttentionMetadata]:
        ids, meta, _ = self.upload(self.decode_inputs(batch, rows))
        return ids, meta

    def _announce_graph(self, key) -> None:
        """With tensor parallelism: tells the other ranks which graph to replay (the graph
        itself broadcasts its inputs, cuda_graph.py)."""

    def _announce_prefill_graph(self, key) -> None:
        """The same for a prefill graph (prefill_graph.py)."""

    @staticmethod
    def _processed(seqs: list[Sequence]) -> bool:
        """Whether the step's logits are masked or biased before the sampler sees them."""
        return any(s.grammar is not None or s.params.logit_bias for s in seqs)

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], filtering: FilterStage, slots=None
    ):
        slots = self._tensor(self.sampler.slots(seqs) if slots is None else slots, torch.int64)
        logits = biased_logits(logits, [s.params.logit_bias for s in seqs], self._tensor)
        states = [s.grammar for s in seqs]
        if any(state is not None for state in states):
            if self._masks is None:
                self._masks = TokenMasks(logits.shape[-1], self.device)
            logits = masked_logits(logits, states, self._masks)
        return self.sampler(logits, slots, filtering)

    def _replay_decode(self, seqs: list[Sequence], filtering: FilterStage | None):
        """The decode graph's logits and tokens for seqs (filtering None: logits only, and
        tokens None)."""
        n = len(seqs)
        ids, sources, pending = self.token_sources(seqs)
        # Logits only: no sampler in the graph (and a draft model's sequences have no slots).
        scratch = [self.graphs.sampler_scratch] * n
        slots = scratch if filtering is None else self.sampler.slots(seqs)
        key = self.graphs.prepare(seqs, ids, sources, slots, filtering)
        if pending:
            f = self.graphs.fields
            self.fill_placeholders(f.ids[:n], f.sources[:n], (ids, sources))
        self._announce_graph(key)
        logits, tokens = self.graphs.replay(key)
        return logits[:n], None if tokens is None else tokens[:n]

    def _replay_prefill(
        self, batch: Batch, bucket: int, seqs: list[Sequence], filtering: FilterStage
    ):
        """The logits and tokens of bucket's prefill graph for the sequences of batch that
        complete (seqs); the others' rows only fill the KV cache."""
        graphs = self.prefill_graphs
        _, sources, pending = self.token_sources(batch.seqs)
        slots = self.sampler.slots(seqs)
        key = graphs.prepare(batch, bucket, sources if pending else None, slots, filtering)
        if pending:  # running sequences' newest tokens, in flight from the step before
            f, rows = graphs.fields, key[0]
            self.fill_placeholders(f.ids[:rows], f.sources[:rows], None)
        self._announce_prefill_graph(key)
        logits, tokens = graphs.replay(key)
        n = len(seqs)
        return logits[:n], None if tokens is None else tokens[:n]

    @torch.inference_mode()
    def sample(self, out: StepOutput) -> None:
        """Samples a step that execute() left unsampled, its grammars' masks as they are now."""
        out.tokens = self._sample(out.logits, out.seqs, out.filtering, out.slots)
        out.sample_later = False

    @torch.inference_mode()
    def execute(self, batch: Batch, sample_later: bool = False) -> StepOutput:
        """Runs the model and the sampler for one step, without waiting for either. With
        sample_later, a step with structured output stops at the logits (sample() then)."""
        seqs = [s for i, s in enumerate(batch.seqs) if batch.completes(i)]
        if batch.is_prefill:
            # Sequences that sample their first token; running ones beside them have slots.
            self.sampler.admit([s for s in seqs if not self.sampler.has_slot(s)])
        filtering = self.sampler.filtering
        n = len(batch.seqs)
        prompt_lp: list = []
        constrained = any(s.grammar is not None for s in seqs)
        # Graphs with the sampler inside serve steps whose logits go to it as they are; a
        # decode step with masks or biases replays a logits-only graph.
        processed = self._processed(seqs)
        graphs_allowed = not processed
        bucket = None  # of the prefill graph that runs this step
        if batch.is_prefill and graphs_allowed and self.prefill_graphs is not None:
            bucket = self.prefill_graphs.bucket(batch)
        if bucket is not None:
            logits, tokens = self._replay_prefill(batch, bucket, seqs, filtering)
        elif batch.is_prefill:
            ids, meta, rows = self.prepare_prefill(batch)
            x, residual = self.model(ids, meta)
            prompt_lp = self._prompt_logprobs(batch, x, residual)
            logits = self.model.compute_logits((x[rows], residual[rows]))
            tokens = None
        elif self.graphs is not None and self.graphs.can_run(n, logits_only=processed):
            logits, tokens = self._replay_decode(batch.seqs, None if processed else filtering)
        else:
            ids, meta = self.prepare_decode(batch, n)
            logits = self.model.compute_logits(self.model(ids, meta))
            tokens = None
        out = StepOutput(seqs, logits, tokens, prompt_lp, filtering)
        if seqs and tokens is None:
            if constrained and sample_later:
                # Read back in between, a sequence may finish and give its slot up.
                out.sample_later, out.slots = True, self.sampler.slots(seqs)
            else:
                self.sample(out)
        return out

    @torch.inference_mode()
    def verify(self, batch: Batch) -> Verified:
        """Runs a decode step with proposals (spec/verify.py) and waits for its tokens."""
        seqs, proposals = batch.seqs, batch.proposals
        filtering = self.sampler.filtering
        graphs = self.verify_graphs
        if graphs is not None and not self._processed(seqs) and graphs.can_run(seqs, proposals):
            kv_slots = [self.blocks.slots(s, len(s) - 1, len(s) + len(p))
                        for s, p in zip(seqs, proposals)]  # fmt: skip
            key = graphs.prepare(seqs, proposals, kv_slots, self.sampler.slots(seqs), filtering)
            logits, tokens = graphs.replay(key)
            order = [(i, j) for j in range(graphs.width) for i, p in enumerate(proposals)
                     if j <= len(p)]  # fmt: skip
            rows, flat = None, tokens.view(-1)  # rows: the logits' rows, for logprobs only
            positions = [j * key[0] + i for i, j in order]
            if self.sampler.state.max_logprobs is not None:
                rows = self._tensor([i * graphs.width + j for i, j in order], torch.int64)
                flat, positions = flat[self._tensor(positions, torch.int64)], None
            return conclude(logits, rows, flat, order, seqs, proposals, self.sampler,
                            self._tensor, positions=positions, taken_back=True)  # fmt: skip
        ids, meta, rows = self.upload(self.inputs.verify(batch))
        with decode_arithmetic():  # each row as a decode step would compute it
            x, residual = self.model(ids, meta)
            logits = self.model.compute_logits((x[rows], residual[rows]))

        def sample(row_logits: torch.Tensor, row_seqs: list[Sequence]) -> torch.Tensor:
            return self._sample(row_logits, row_seqs, filtering)

        return verify_rows(logits, seqs, proposals, sample, self.sampler, self._tensor)

    @torch.inference_mode()
    def last_logits(self, batch: Batch) -> torch.Tensor:
        """Logits after each sequence's last fed token, without sampling (a draft model's
        steps): a decode step when each feeds one token, else laid out as prefill chunks."""
        if all(n == 1 for n in batch.num_new_tokens):
            n = len(batch.seqs)
            if self.graphs is not None and self.graphs.can_run(n, logits_only=True):
                return self._replay_decode(batch.seqs, None)[0]
            ids, meta = self.prepare_decode(batch, n)
            return self.model.compute_logits(self.model(ids, meta))
        ids, meta, rows = self.prepare_prefill(batch)
        x, residual = self.model(ids, meta)
        return self.model.compute_logits((x[rows], residual[rows]))

    def keep_last(self, tokens: torch.Tensor, seqs: list[Sequence]) -> None:
        """tokens (on the device) are the newest, still in flight, of seqs in turn: the
        next step takes them from there (a launched step's, or a draft model's step's)."""
        self._last_tokens = tokens
        self._last_rows = {s.seq_id: i for i, s in enumerate(seqs)}

    def compute_logits(self, batch: Batch) -> torch.Tensor:
        """[number of sequences that complete this step, vocab] float32 logits (the step's
        sampler runs too)."""
        return self.execute(batch).logits

    def _prompt_logprobs(self, batch: Batch, x: torch.Tensor, residual: torch.Tensor) -> list:
        """The log-probability of each prompt token this chunk predicts, with the top-N."""
        found = []
        plan = prompt_logprob_plan(batch)
        for seq, first, rows, chunk in plan:
            logits = self.model.compute_logits((x[rows], residual[rows]))
            ids = self._tensor(chunk, torch.int64)
            tensors = self.sampler.logprobs(logits, ids, seq.params.prompt_logprobs)
            found.append((seq, first, tuple(self._to_host(t) for t in tensors)))
        for seq, first, _, chunk in plan:
            seq.prompt_logprobs_launched = first + len(chunk)
        return found

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self._pin:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], last: int | None = None) -> torch.Tensor:
        """float32 logits after each of the last `last` positions of token_ids (all when None),
        from one prefill: what the model predicts after every prefix (teacher forcing)."""
        seq = Sequence(token_ids, SamplingParams())
        self.blocks.grow(seq, len(seq))
        try:
            inputs = self.inputs.prefill(Batch([seq], True, [len(seq)]))
            inputs.logit_rows = list(range(max(0, len(seq) - (last or len(seq))), len(seq)))
            ids, meta, rows = self.upload(inputs)
            x, residual = self.model(ids, meta)
            return self.model.compute_logits((x[rows], residual[rows]))
        finally:
            self.blocks.free(seq)

    @torch.inference_mode()
    def launch(self, batch: Batch) -> LaunchedStep:
        """Queues one step on the device and returns at once; result() waits for it. A step
        with structured output is queued up to its logits: its LaunchedStep samples at
        complete(), once the engine has read back the step before."""
        out = self.execute(batch, sample_later=True)
        step = LaunchedStep(out.seqs, None, None, None, prompt_logprobs=out.prompt_logprobs)
        if out.sample_later:
            step.pending = lambda: self._finish(step, out)
        else:
            self._finish(step, out)
        return step

    @torch.inference_mode()
    def _finish(self, step: LaunchedStep, out: StepOutput) -> None:
        """The step's sampling (when left for later), logprobs and read-back copies."""
        if out.sample_later:
            self.sample(out)
        seqs, tokens = out.seqs, out.tokens
        if tokens is None:
            tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        top = self.sampler.state.max_logprobs
        if seqs and top is not None:
            raw = self.sampler.logprobs(out.logits, tokens, top)
            step.logprobs = tuple(self._to_host(t) for t in raw)
        if seqs:
            self.keep_last(tokens, seqs)
        step.tokens, step.host = tokens, self._to_host(tokens)
        if self._pin:
            step.done = torch.cuda.Event()
            step.done.record()
