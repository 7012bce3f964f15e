"""The sampler's full-vocabulary passes, in three implementations with one interface: Triton
kernels on CUDA (kernels/triton/sample.py), C on the CPU (kernels/cpu/sample.c) and torch ops
(anywhere; the CPU's where the C library cannot be built). All compute the same function:
the tests compare them against each other and against the reference sampler."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoqwen.kernels.cpu import sample as native
from nanoqwen.kernels.sampling_layout import (
    F_FREQUENCY,
    F_MIN_P,
    F_PRESENCE,
    F_REPETITION,
    F_TEMPERATURE,
    F_TOP_P,
    FLAG_BAN,
    FLAG_GREEDY,
    I_FLAGS,
    I_MIN_TOKENS,
    I_SEED,
    I_TOP_K,
)
from nanoqwen.runtime.sampling.filter_stage import FilterStage
from nanoqwen.runtime.sampling.noise import gumbel
from nanoqwen.runtime.sampling.state import SamplingState

NEG_INF = float("-inf")


@dataclass
class Prepared:
    """Per row of a batch: the processed logits z (penalties, bans, temperature applied) and
    the sum of exp(z - m) (both only when asked for), their max m, the argmax of z (the
    greedy token) and, when asked for, a sample from softmax(z) with no filter."""

    z: torch.Tensor | None
    m: torch.Tensor
    s: torch.Tensor | None
    greedy: torch.Tensor
    sampled: torch.Tensor | None


class TorchPasses:
    """Torch ops: the CPU engine's sampler, and the GPU kernels' reference in the tests."""

    def prepare(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        state: SamplingState,
        write_z: bool,
        sample: bool,
    ) -> Prepared:
        f, i = state.fparams[slots], state.iparams[slots]
        x = logits
        if state.any_penalties:
            # Rows without penalties have repetition 1 and presence/frequency 0 here, which
            # leave their logits exactly as they are.
            counts = state.counts[slots]
            seen = state.prompt_mask[slots] | (counts > 0)
            rep = f[:, F_REPETITION, None]
            x = torch.where(seen, torch.where(x < 0, x * rep, x / rep), x)
            x = x - f[:, F_FREQUENCY, None] * counts - f[:, F_PRESENCE, None] * (counts > 0)
        if state.any_bans:
            active = ((i[:, I_FLAGS] & FLAG_BAN) != 0) & (state.out_pos[slots] < i[:, I_MIN_TOKENS])
            x = x.masked_fill(state.ban_mask[slots] & active[:, None], NEG_INF)
        # Greedy rows hold temperature 1.0: with no sampling row held, z is x as it is, and
        # the pass over every logit (~50 µs a row of 151,936 on the CPU) is skipped.
        z = x / f[:, F_TEMPERATURE, None] if state.any_sampled else x
        m, greedy = z.max(dim=1)  # one pass; z.argmax alone is 3x slower on the CPU
        # The sum of exponentials only feeds the filters' thresholds (write_z).
        s = torch.exp(z - m[:, None]).sum(dim=1) if write_z else None
        sampled = None
        if sample:
            sampled = self._gumbel_argmax(z, slots, state) if state.any_sampled else greedy
        return Prepared(z if write_z else None, m, s, greedy, sampled)

    @staticmethod
    def _gumbel_argmax(z: torch.Tensor, slots: torch.Tensor, state: SamplingState):
        noise = gumbel(state.iparams[slots, I_SEED], state.out_pos[slots], z.shape[1])
        return (z + noise).argmax(dim=1)

    def step(self, logits, slots, state: SamplingState, filtering: int, candidates: int):
        greedy_rows = (state.iparams[slots, I_FLAGS] & FLAG_GREEDY) != 0
        if filtering:
            out = self.prepare(logits, slots, state, write_z=True, sample=False)
            z = out.z.masked_fill(
                out.z < self.thresholds(out, slots, state, candidates)[:, None], NEG_INF
            )
            sampled = self._gumbel_argmax(z, slots, state)
        else:
            out = self.prepare(logits, slots, state, write_z=False, sample=True)
            sampled = out.sampled
        tokens = torch.where(greedy_rows, out.greedy, sampled)
        state.record(slots, tokens)
        return tokens

    def filtered(self, logits, slots, state: SamplingState, candidates: int) -> torch.Tensor:
        out = self.prepare(logits, slots, state, write_z=True, sample=False)
        tau = self.thresholds(out, slots, state, candidates)
        return out.z.masked_fill(out.z < tau[:, None], NEG_INF)

    def thresholds(self, out: Prepared, slots, state: SamplingState, candidates: int):
        """Per row, the smallest processed logit that top-k, top-p and min-p keep (the
        reference's sorted rule, read off the `candidates` largest values)."""
        z, m = out.z, out.m
        vocab = z.shape[1]
        cap = min(candidates, vocab)
        f, i = state.fparams[slots], state.iparams[slots]
        top_k, top_p, min_p = i[:, I_TOP_K], f[:, F_TOP_P], f[:, F_MIN_P]
        values = z.topk(cap, dim=1).values  # sorted, most likely first
        k_on = top_k < vocab
        k_inside = k_on & (top_k <= cap)
        kth = values.gather(1, (top_k.clamp(1, cap) - 1)[:, None]).squeeze(1)
        tau_k = torch.where(k_inside, kth, NEG_INF)
        # top-p over the top-k survivors, renormalised (HF); without top-k, over the row.
        e = torch.exp(values - m[:, None]) * (values >= tau_k[:, None])
        total = torch.where(k_inside, e.sum(dim=1), out.s)
        probs = e / total[:, None]
        cum = probs.cumsum(dim=1)
        before = cum - probs
        p_on = top_p < 1.0
        kept = (before < top_p[:, None]).sum(dim=1).clamp(min=1)
        tau_p = torch.where(p_on, values.gather(1, (kept - 1)[:, None]).squeeze(1), NEG_INF)
        # Past the candidates: a top-k beyond them; a top-p mass they do not reach; tokens
        # tied with the k-th beyond them (the top-k mass misses them).
        k_past = k_on & ~k_inside
        tie_past = k_inside & (values[:, cap - 1] >= tau_k) & (cap < vocab)
        p_past = p_on & ((~k_on & (cum[:, -1] < top_p)) | k_past | tie_past)
        need = k_past.long() | (p_past.long() << 1)
        self._whole_row_thresholds(z, need, top_k, top_p, tau_k, tau_p, m)
        tau_min = torch.where(min_p > 0, m + torch.log(min_p), NEG_INF)
        return torch.maximum(torch.maximum(tau_k, tau_p), tau_min)

    @staticmethod
    def _whole_row_thresholds(z, need, top_k, top_p, tau_k, tau_p, m) -> None:
        """The thresholds over the whole sorted row, for the rows flagged in need (bit 1:
        top-k, bit 2: top-p). Host loop: this implementation serves CPU tensors."""
        for r in need.nonzero().flatten().tolist():
            flags = int(need[r])
            values = z[r].sort(descending=True).values
            if flags & 1:
                tau_k[r] = values[int(top_k[r]) - 1]
            if flags & 2:
                kept = values[values >= tau_k[r]]
                q = torch.exp(kept - m[r])
                q = q / q.sum()
                before = q.cumsum(0) - q
                n = max(1, int((before < top_p[r]).sum()))
                tau_p[r] = kept[n - 1]


class TritonPasses:
    """The same function in Triton kernels (kernels/triton/sample.py, sampling_thresholds.py)."""

    def __init__(self) -> None:
        from nanoqwen.kernels.triton import sample  # Triton only where the device runs it

        self.kernels = sample

    def step(self, logits, slots, state, filtering: int, candidates: int) -> torch.Tensor:
        if filtering == FilterStage.NUCLEUS:
            return self.kernels.nucleus_step(logits, slots, state)
        if filtering:
            return self.kernels.filter_step(logits, slots, state, candidates)
        return self.kernels.plain_step(logits, slots, state)

    def filtered(self, logits, slots, state, candidates: int) -> torch.Tensor:
        z, tau, _, _ = self.kernels.filter_thresholds(logits, slots, state, candidates)
        return z.masked_fill(z < tau[:, None], NEG_INF)


class NativePasses:
    """The same function in C (kernels/cpu/sample.c): one call a step on the CPU, where the
    torch ops took 3.7 ms a row of 151,936 logits with the CLI's default settings."""

    @staticmethod
    def _options(state: SamplingState, filtering: int) -> int:
        return (
            native.PENALTIES * state.any_penalties
            | native.BANS * state.any_bans
            | native.SAMPLED * state.any_sampled
            | native.FILTERING * bool(filtering)
        )

    def step(self, logits, slots, state, filtering: int, candidates: int) -> torch.Tensor:
        tokens = torch.empty(logits.shape[0], dtype=torch.int64)
        options = self._options(state, filtering) | native.RECORD
        native.sample_rows(logits, slots, state, options, candidates, tokens=tokens)
        return tokens

    def filtered(self, logits, slots, state, candidates: int) -> torch.Tensor:
        z = torch.empty(logits.shape, dtype=torch.float32)
        tau = torch.empty(logits.shape[0], dtype=torch.float32)
        native.sample_rows(logits, slots, state, self._options(state, True), candidates, z, tau)
        return z.masked_fill(z < tau[:, None], NEG_INF)
