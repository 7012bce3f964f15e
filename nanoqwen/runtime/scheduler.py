"""Continuous batching: decides which sequences run in each step: waiting prompts' chunks
beside the running sequences' next tokens, in one token budget."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from nanoqwen.runtime.kv.block_manager import BlockManager
from nanoqwen.runtime.sequence import Sequence, SequenceStatus

PREEMPTION_MODES = ("swap", "recompute")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # swap: a preempted sequence's blocks go to the host pool and come back before it
    # resumes (recompute when the host pool is missing or full); recompute: they are dropped
    # and its tokens prefilled again (with prefix caching, only those no longer cached).
    preemption_mode: str = "swap"

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode={self.preemption_mode!r} is unknown: allowed "
                + ", ".join(PREEMPTION_MODES)
            )


@dataclass
class Batch:
    seqs: list[Sequence]
    # A prefill step lays its tokens out as chunks, and may carry running sequences' next
    # tokens too (chunks of 1); a decode step is one token per sequence.
    is_prefill: bool
    # Tokens each sequence feeds this step: a prompt chunk in prefill, always 1 in decode.
    num_new_tokens: list[int]
    # Speculative decoding: tokens proposed to follow each sequence (decode only), which
    # the step checks after its newest token; None when nothing is proposed.
    proposals: list[list[int]] | None = None

    def completes(self, i: int) -> bool:
        """Whether sequence i reaches its last token this step, and so samples a new one."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == len(seq)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        on_release: Callable[[Sequence], None] | None = None,
        propose: Callable[[list[Sequence]], list[list[int]]] | None = None,
    ) -> None:
        self.config = config
        self.blocks = block_manager
        # Told when a sequence samples no more (retired, finished or preempted), so the
        # sampler can hand its slot on.
        self.on_release = on_release or (lambda seq: None)
        # Speculative decoding: the tokens proposed to follow each of the running sequences.
        self.propose = propose
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # oldest first
        self.num_preemptions = 0
        self.num_swaps = 0  # preemptions by swapping, of num_preemptions

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> Batch | None:
        # Blocks filled by the last step become reusable by the sequences admitted now.
        if self.waiting and self.waiting[0].block_table:
            self.blocks.register_computed(self.waiting[0])
        for seq in self.running:
            self.blocks.register_computed(seq)
        self._swap_in()
        if self.running and self.waiting and self.propose is None and self._needs_chunks():
            return self._schedule_mixed()
        return self._schedule_prefill() or self._schedule_decode()

    def _needs_chunks(self) -> bool:
        """Whether the next prompt is longer than one step takes beside the running
        sequences. A shorter one prefills in a step of its own, as short as that mixed step
        would be, and the decode steps around it keep their CUDA graphs: mixed steps run
        eagerly. A prompt part-way through its chunks is judged by its whole length: a long
        one keeps its running neighbours company to its last chunk, and a short one that the
        budget of the step before cut finishes in a prefill step (mixing it would make every
        step of a burst of short prompts mixed, none of them sooner done)."""
        head = self.waiting[0]
        budget = self.config.max_num_batched_tokens - len(self.running)
        tokens = len(head) if head.block_table else head.num_uncomputed_tokens
        return tokens > budget

    def _schedule_mixed(self) -> Batch | None:
        """Every running sequence decodes, and waiting prompts prefill in the token budget
        left, so a long prompt arriving does not stop the running streams for its whole
        prefill. (With speculative decoding, prompts go first: a verify step has its own
        layout.)"""
        decode = self._schedule_decode()
        if decode is None:  # all preempted
            return self._schedule_prefill()
        budget = self.config.max_num_batched_tokens - len(decode.seqs)
        prefill = self._schedule_prefill(budget) if budget > 0 else None
        if prefill is None:
            return decode
        return Batch(
            decode.seqs + prefill.seqs, True, decode.num_new_tokens + prefill.num_new_tokens
        )

    def _swap_in(self) -> None:
        """Swapped-out sequences come back, oldest first, as soon as they fit."""
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            if not self.blocks.can_swap_in(seq):
                break
            self.swapped.pop(0)
            self.blocks.swap_in(seq)
            seq.status = SequenceStatus.RUNNING
            # In arrival order, so the newest running sequence is still the next victim.
            bisect.insort(self.running, seq, key=lambda s: s.seq_id)

    def _schedule_prefill(self, budget: int | None = None) -> Batch | None:
        budget = self.config.max_num_batched_tokens if budget is None else budget
        seqs: list[Sequence] = []
        counts: list[int] = []
        while self.waiting and budget > 0:
            # Admitted prompts are already in self.running (only a partial one is not, and
            # it ends the loop), so counting seqs too would halve the admissions per step.
            if len(self.running) >= self.config.max_num_seqs:
                break
            seq = self.waiting[0]
            if self.swapped and not seq.block_table:
                break  # swapped-out sequences resume before new ones start
            # A prompt gets all its blocks up front, so a chunked prefill never stalls halfway;
            # a cached prefix counts as computed already.
            if not seq.block_table and not self.blocks.admit(seq):
                break
            n = min(seq.num_uncomputed_tokens, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n
            if n < seq.num_uncomputed_tokens:
                break  # the rest of this prompt goes in the next step; it stays at the head
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return Batch(seqs, True, counts) if seqs else None

    def _schedule_decode(self) -> Batch | None:
        scheduled: list[Sequence] = []
        running = deque(self.running)
        # Speculative decoding's guesses, by sequence id; none (and no per-sequence work for
        # them, this loop runs for every sequence at every step) without a proposer.
        guesses = None
        if self.propose is not None and running:
            guesses = {s.seq_id: p for s, p in zip(running, self.propose(list(running)))}
        proposals: list[list[int]] = []
        while running:
            seq = running.popleft()
            length = len(seq)
            proposal = guesses.get(seq.seq_id, []) if guesses else []
            if proposal and not self.blocks.can_grow(seq, length + len(proposal)):
                proposal = []  # a guess never preempts anyone
            while not self.blocks.can_grow(seq, length):
                victim = running.pop() if running else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq, length + len(proposal) if proposal else length)
                scheduled.append(seq)
                if guesses:
                    proposals.append(proposal)
        self.running = scheduled
        if not scheduled:
            return None
        # A list of its own: finishing and admitted sequences change self.running.
        seqs = list(scheduled)
        return Batch(seqs, False, [1] * len(seqs), proposals if any(proposals) else None)

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        if self.config.preemption_mode == "swap" and self.blocks.can_swap_out(seq):
            # It keeps its sampling slot (counts, output position) and resumes in decode.
            # Running plus swapped sequences never exceed max_num_seqs, the slots there are:
            # nothing new is admitted while any is swapped out.
            self.blocks.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=lambda s: s.seq_id)
            self.num_swaps += 1
            return
        # Recompute later: drop its cache and put it first in line.
        self.blocks.free(seq)
        self.on_release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        # Behind a half-prefilled head: that one already holds its blocks and must finish.
        head_holds_blocks = bool(self.waiting and self.waiting[0].block_table)
        self.waiting.insert(1 if head_holds_blocks else 0, seq)

    def retire(self, seq: Sequence) -> None:
        """Stop scheduling seq (its last token is in flight and ends it); its blocks stay
        until finish()."""
        if seq in self.running:
            self.running.remove(seq)
        self.on_release(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.blocks.free(seq)
        self.on_release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
