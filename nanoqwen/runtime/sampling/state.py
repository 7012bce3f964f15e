"""SamplingState: every running request's sampling settings and token statistics, kept on the
device in slot-indexed tables.

A request takes a slot when it samples its first token (the end of its prefill, or of its
recompute after a preemption) and gives it back when it finishes or is preempted. Only then
does the host write to the tables, in a few batched non-blocking copies; each step the
sampler reads them by slot and adds the tokens it sampled on the device itself, so a step
needs no per-row host data besides the slot ids.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from nanoqwen.kernels.sampling_layout import (
    F_FREQUENCY,
    F_MIN_P,
    F_PRESENCE,
    F_REPETITION,
    F_TEMPERATURE,
    F_TOP_P,
    FLAG_BAN,
    FLAG_GREEDY,
    FLAG_PENALTY,
    I_FLAGS,
    I_MIN_TOKENS,
    I_SEED,
    I_TOP_K,
    NUM_F,
    NUM_I,
)
from nanoqwen.runtime.lazy_zeros import lazy_zeros
from nanoqwen.runtime.sequence import Sequence


@dataclass
class SlotSettings:
    """What the host remembers of a slot: which per-step options it turns on."""

    filters: bool  # top-k, top-p or min-p on a sampled row
    cuts: bool  # top-k or min-p on a sampled row (a threshold the draw needs first)
    logprobs: int | None
    penalties: bool
    bans: bool
    sampled: bool  # not greedy


class SamplingState:
    def __init__(
        self, capacity: int, vocab: int, device: torch.device, eos_token_ids: frozenset[int]
    ) -> None:
        self.vocab = vocab
        self.device = device
        self.eos_token_ids = eos_token_ids
        # One slot past the capacity: padding rows of a captured batch sample there.
        self.scratch = capacity
        rows = capacity + 1
        self.fparams = torch.zeros(rows, NUM_F, dtype=torch.float32, device=device)
        self.iparams = torch.zeros(rows, NUM_I, dtype=torch.int64, device=device)
        self.fparams[:, [F_TEMPERATURE, F_TOP_P, F_REPETITION]] = 1.0
        self.iparams[:, I_TOP_K] = vocab
        self.iparams[:, I_FLAGS] = FLAG_GREEDY
        self.out_pos = torch.zeros(rows, dtype=torch.int64, device=device)
        # Penalties: tokens of the prompt, and how often each token was generated. Lazily
        # zeroed on the CPU: 234 MB at the default 256 slots and Qwen's vocabulary, of which
        # a CLI run touches the rows of a few slots.
        self.prompt_mask = lazy_zeros((rows, vocab), torch.bool, device)
        self.counts = lazy_zeros((rows, vocab), torch.int32, device)
        # One bit a token, set for every token in a slot's prompt or outputs (and left set
        # where unrecord takes an output back): the Triton penalty pass reads the two tables
        # above only where it is set. Kept by admit and every record of an output.
        self.maybe_seen = lazy_zeros((rows, -(-vocab // 32)), torch.int32, device)
        # min_tokens: the tokens that may not be sampled yet (EOS and stop tokens).
        self.ban_mask = lazy_zeros((rows, vocab), torch.bool, device)
        self._free = list(range(capacity - 1, -1, -1))
        self._slot_of: dict[int, int] = {}
        self._settings: dict[int, SlotSettings] = {}
        self._pin = device.type == "cuda"
        self._seeds = random.Random()  # unseeded requests get a seed drawn here
        self._needs: Counter[str] = Counter()
        self._logprobs: Counter[int] = Counter()

    # ---- what the held slots need (kept as counts: read every step) -----------------------
    @property
    def any_filters(self) -> bool:
        return self._needs["filters"] > 0

    @property
    def any_cuts(self) -> bool:
        return self._needs["cuts"] > 0

    @property
    def any_penalties(self) -> bool:
        return self._needs["penalties"] > 0

    @property
    def any_bans(self) -> bool:
        return self._needs["bans"] > 0

    @property
    def any_sampled(self) -> bool:
        return self._needs["sampled"] > 0

    @property
    def max_logprobs(self) -> int | None:
        """The most top alternatives any held slot asks for; None when none asks."""
        return max(self._logprobs) if self._logprobs else None

    def _count(self, settings: SlotSettings, sign: int) -> None:
        for name in ("filters", "cuts", "penalties", "bans", "sampled"):
            self._needs[name] += sign * getattr(settings, name)
        if settings.logprobs is not None:
            self._logprobs[settings.logprobs] += sign
            if not self._logprobs[settings.logprobs]:
                del self._logprobs[settings.logprobs]

    def has_slot(self, seq: Sequence) -> bool:
        return seq.seq_id in self._slot_of

    def slot(self, seq: Sequence) -> int:
        return self._slot_of[seq.seq_id]

    # ---- slots come and go -----------------------------------------------------------------
    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        if self._pin:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def admit(self, seqs: list[Sequence]) -> None:
        """(Re)initialises the slots of sequences about to sample their first token (again,
        after a preemption): settings, output position, and the token tables from their
        token ids, which must all be known by now."""
        if not seqs:
            return
        n = len(seqs)
        slots = np.empty(n, dtype=np.int64)
        fparams = np.zeros((n, NUM_F), dtype=np.float32)
        iparams = np.zeros((n, NUM_I), dtype=np.int64)
        positions = np.empty(n, dtype=np.int64)
        prompt_rows, prompt_ids, count_rows, count_ids, ban_rows, ban_ids = [], [], [], [], [], []
        for i, seq in enumerate(seqs):
            slot = self._slot_of.get(seq.seq_id)
            if slot is None:
                if not self._free:
                    raise RuntimeError("no sampling slot left: more running sequences than slots")
                slot = self._slot_of[seq.seq_id] = self._free.pop()
            slots[i] = slot
            if slot in self._settings:  # readmitted after a preemption it survived
                self._count(self._settings[slot], -1)
            settings = self._row(seq, fparams[i], iparams[i])
            self._settings[slot] = settings
            self._count(settings, +1)
            positions[i] = seq.num_output_tokens
            if settings.penalties:
                prompt = sorted(set(seq.token_ids[: seq.num_prompt_tokens]))
                prompt_rows += [slot] * len(prompt)
                prompt_ids += prompt
                outputs = seq.output_token_ids
                count_rows += [slot] * len(outputs)
                count_ids += outputs
            if settings.bans:
                banned = self._banned(seq)
                ban_rows += [slot] * len(banned)
                ban_ids += banned
        slots_d = self._to_device(slots)
        self.fparams.index_copy_(0, slots_d, self._to_device(fparams))
        self.iparams.index_copy_(0, slots_d, self._to_device(iparams))
        self.out_pos.index_copy_(0, slots_d, self._to_device(positions))
        penalised = [s for s in slots if self._settings[int(s)].penalties]
        if penalised:
            rows = self._to_device(np.array(penalised, dtype=np.int64))
            self.prompt_mask.index_fill_(0, rows, False)
            self.counts.index_fill_(0, rows, 0)
            self._scatter(self.prompt_mask, prompt_rows, prompt_ids, accumulate=False)
            self._scatter(self.counts, count_rows, count_ids, accumulate=True)
            seen = self._seen_bits(penalised, prompt_rows + count_rows, prompt_ids + count_ids)
            self.maybe_seen.index_copy_(0, rows, self._to_device(seen))
        banning = [s for s in slots if self._settings[int(s)].bans]
        if banning:
            self.ban_mask.index_fill_(0, self._to_device(np.array(banning, dtype=np.int64)), False)
            self._scatter(self.ban_mask, ban_rows, ban_ids, accumulate=False)

    def _scatter(self, table: torch.Tensor, rows: list[int], ids: list[int], accumulate: bool):
        if not ids:
            return
        index = self._to_device(np.array([rows, ids], dtype=np.int64))
        ones = torch.ones(len(ids), dtype=table.dtype, device=self.device)
        table.index_put_((index[0], index[1]), ones, accumulate=accumulate)

    def _seen_bits(self, slots: list[int], rows: list[int], ids: list[int]) -> np.ndarray:
        """maybe_seen's rows for slots: the bits of each (row, id) pair set."""
        bits = np.zeros((len(slots), self.maybe_seen.shape[1]), dtype=np.uint32)
        where = {slot: i for i, slot in enumerate(slots)}
        index = np.array([where[r] for r in rows], dtype=np.int64)
        tokens = np.array(ids, dtype=np.int64)
        one_bit = np.uint32(1) << (tokens & 31).astype(np.uint32)
        np.bitwise_or.at(bits, (index, tokens >> 5), one_bit)
        return bits.view(np.int32)

    def _banned(self, seq: Sequence) -> list[int]:
        ids = set(seq.params.stop_token_ids) | set(self.eos_token_ids)
        return sorted(t for t in ids if 0 <= t < self.vocab)

    def _row(self, seq: Sequence, f: np.ndarray, i: np.ndarray) -> SlotSettings:
        p = seq.params
        if seq.sampling_seed is None:
            seq.sampling_seed = p.seed if p.seed is not None else self._seeds.getrandbits(63)
        greedy = p.greedy
        top_k = self.vocab if p.top_k == -1 else min(p.top_k, self.vocab)
        # Top-k and min-p cut before the draw (a threshold first); top-p alone need not.
        cuts = not greedy and (top_k < self.vocab or p.min_p > 0.0)
        filters = cuts or (not greedy and p.top_p < 1.0)
        bans = p.min_tokens > 0 and bool(self._banned(seq))
        f[F_TEMPERATURE] = 1.0 if greedy else p.temperature
        f[F_TOP_P] = p.top_p if filters else 1.0
        f[F_MIN_P] = p.min_p if filters else 0.0
        f[F_REPETITION] = p.repetition_penalty
        f[F_PRESENCE] = p.presence_penalty
        f[F_FREQUENCY] = p.frequency_penalty
        i[I_TOP_K] = top_k if filters else self.vocab
        i[I_MIN_TOKENS] = p.min_tokens
        i[I_SEED] = seq.sampling_seed
        i[I_FLAGS] = (
            (FLAG_GREEDY if greedy else 0)
            | (FLAG_PENALTY if p.needs_penalties else 0)
            | (FLAG_BAN if bans else 0)
        )
        return SlotSettings(filters, cuts, p.logprobs, p.needs_penalties, bans, not greedy)

    def release(self, seq: Sequence) -> None:
        slot = self._slot_of.pop(seq.seq_id, None)
        if slot is not None:
            self._count(self._settings.pop(slot), -1)
            self._free.append(slot)

    # ---- what a step changes ---------------------------------------------------------------
    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """The tokens just sampled count as outputs of their slots (device-side only)."""
        self.counts.index_put_(
            (slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True
        )
        # The rows' slots are distinct but for padding's scratch slot, which has no penalties.
        words = (slots, tokens >> 5)
        bits = (torch.ones_like(tokens) << (tokens & 31)).to(torch.int32)
        self.maybe_seen.index_put_(words, self.maybe_seen[words] | bits)
        self.out_pos.index_add_(0, slots, torch.ones_like(slots))

    def unrecord(self, slots: torch.Tensor, tokens: torch.Tensor, dropped=None) -> None:
        """Takes back record(slots, tokens): speculative rows past a rejection. dropped
        (int32, 0 or 1 a row) takes back only the rows marked 1, from device data alone (a
        verify graph knows its rejections only on the device). Atomic adds, no sort:
        capturable."""
        if dropped is None:
            dropped = torch.ones_like(tokens, dtype=torch.int32)
        self.counts.view(-1).index_add_(0, slots * self.vocab + tokens, -dropped)
        self.out_pos.index_add_(0, slots, -dropped.to(self.out_pos.dtype))
