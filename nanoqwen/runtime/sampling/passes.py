"""The sampler's full-vocabulary passes, in two implementations with one interface: Triton
kernels on CUDA (kernels/sampling.py) and torch ops elsewhere. Both compute the same
function: the tests compare them against each other and against the reference sampler."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoqwen.kernels.sampling_layout import (
    F_FREQUENCY,
    F_PRESENCE,
    F_REPETITION,
    F_TEMPERATURE,
    FLAG_BAN,
    I_FLAGS,
    I_MIN_TOKENS,
    I_SEED,
)
from nanoqwen.runtime.sampling.noise import gumbel
from nanoqwen.runtime.sampling.state import SamplingState

NEG_INF = float("-inf")


@dataclass
class Prepared:
    """Per row of a batch: the processed logits z (penalties, bans, temperature applied;
    only when asked for), their max m and sum of exp(z - m), the argmax of z (the greedy
    token) and, when asked for, a sample from softmax(z) with no filter."""

    z: torch.Tensor | None
    m: torch.Tensor
    s: torch.Tensor
    greedy: torch.Tensor
    sampled: torch.Tensor | None


class TorchPasses:
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
        z = x / f[:, F_TEMPERATURE, None]
        m = z.amax(dim=1)
        greedy = z.argmax(dim=1)
        s = torch.exp(z - m[:, None]).sum(dim=1)
        sampled = None
        if sample:
            sampled = self._gumbel_argmax(z, slots, state) if state.any_sampled else greedy
        return Prepared(z if write_z else None, m, s, greedy, sampled)

    @staticmethod
    def _gumbel_argmax(z: torch.Tensor, slots: torch.Tensor, state: SamplingState):
        noise = gumbel(state.iparams[slots, I_SEED], state.out_pos[slots], z.shape[1])
        return (z + noise).argmax(dim=1)

    def sample_above(
        self, z: torch.Tensor, tau: torch.Tensor, slots: torch.Tensor, state: SamplingState
    ) -> torch.Tensor:
        return self._gumbel_argmax(z.masked_fill(z < tau[:, None], NEG_INF), slots, state)

    def threshold_fallback(self, z, need, top_k, top_p, tau_k, tau_p, m) -> None:
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
    def prepare(self, logits, slots, state, write_z: bool, sample: bool) -> Prepared:
        from nanoqwen.kernels import sampling as kernels

        z, (pmax, psum, parg, pgval, pgidx) = kernels.prepare(logits, slots, state, write_z, sample)
        tile = pmax.argmax(dim=1, keepdim=True)  # the first tile holding the max
        m = pmax.gather(1, tile)
        s = (psum * torch.exp(pmax - m)).sum(dim=1)
        greedy = parg.gather(1, tile).squeeze(1).long()
        sampled = None
        if sample:
            sampled = pgidx.gather(1, pgval.argmax(dim=1, keepdim=True)).squeeze(1).long()
        return Prepared(z, m.squeeze(1), s, greedy, sampled)

    def sample_above(self, z, tau, slots, state) -> torch.Tensor:
        from nanoqwen.kernels import sampling as kernels

        pgval, pgidx = kernels.sample_above(z, tau.contiguous(), slots, state)
        return pgidx.gather(1, pgval.argmax(dim=1, keepdim=True)).squeeze(1).long()

    def threshold_fallback(self, z, need, top_k, top_p, tau_k, tau_p, m) -> None:
        from nanoqwen.kernels import sampling as kernels

        kernels.threshold_fallback(z, need, top_k, top_p, tau_k, tau_p, m)
