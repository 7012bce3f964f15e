"""Sampler: picks each row's next token on the device, with no host sync and no per-step host
data but the rows' slot ids, so the whole of it is captured in the decode CUDA graphs.

Per row (the semantics of reference.py, HF's order):
1. processed logits z: penalties from the slot's token tables, min_tokens bans, temperature
   (greedy rows: temperature 1, and their token is the argmax of z);
2. top-k, top-p and min-p each keep the tokens of z above a threshold, so together they keep
   z >= tau with tau the largest of the three. The thresholds come from the CANDIDATES most
   likely tokens (one top-k, no full sort); a row whose top-k or top-p boundary lies past
   them gets it from a bisection over its whole row (a kernel whose other rows return at
   once). min-p's is closed-form: z >= max(z) + log(min_p);
3. a Gumbel-max draw over the kept tokens, with counter-based noise keyed by (seed, output
   position, token): a seeded request's tokens do not depend on its batch.
Batches with no filtering row skip step 2 and draw in the same pass as step 1.
"""

from __future__ import annotations

import torch

from nanoqwen.kernels.sampling_layout import F_MIN_P, F_TOP_P, FLAG_GREEDY, I_FLAGS, I_TOP_K
from nanoqwen.runtime.sampling.passes import NEG_INF, Prepared, TorchPasses, TritonPasses
from nanoqwen.runtime.sampling.state import SamplingState
from nanoqwen.runtime.sequence import Sequence

CANDIDATES = 256


class Sampler:
    def __init__(
        self, eos_token_ids: frozenset[int], vocab: int, capacity: int, device: torch.device
    ) -> None:
        self.state = SamplingState(capacity, vocab, device, eos_token_ids)
        self.passes = TritonPasses() if device.type == "cuda" else TorchPasses()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.state.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.state.eos_token_ids = ids

    # ---- slots ------------------------------------------------------------------------------
    def admit(self, seqs: list[Sequence]) -> None:
        self.state.admit(seqs)

    def release(self, seq: Sequence) -> None:
        self.state.release(seq)

    def slots(self, seqs: list[Sequence]) -> list[int]:
        return [self.state.slot(s) for s in seqs]

    @property
    def filtering(self) -> bool:
        """Whether the next step needs the filter stage (a held slot uses top-k/p, min-p)."""
        return self.state.any_filters

    # ---- one step ---------------------------------------------------------------------------
    def __call__(self, logits: torch.Tensor, slots: torch.Tensor, filtering: bool) -> torch.Tensor:
        """logits: [rows, vocab] float32, slots: [rows] int64 -> next tokens [rows] int64.
        The tokens also count as outputs of their slots (penalties, positions)."""
        st = self.state
        greedy_rows = (st.iparams[slots, I_FLAGS] & FLAG_GREEDY) != 0
        if filtering:
            out = self.passes.prepare(logits, slots, st, write_z=True, sample=False)
            tau = self.thresholds(out, slots)
            sampled = self.passes.sample_above(out.z, tau, slots, st)
        else:
            out = self.passes.prepare(logits, slots, st, write_z=False, sample=True)
            sampled = out.sampled
        tokens = torch.where(greedy_rows, out.greedy, sampled)
        st.record(slots, tokens)
        return tokens

    def thresholds(self, out: Prepared, slots: torch.Tensor) -> torch.Tensor:
        """Per row, the smallest processed logit that top-k, top-p and min-p keep."""
        z, m = out.z, out.m
        vocab = z.shape[1]
        cap = min(CANDIDATES, vocab)
        f, i = self.state.fparams[slots], self.state.iparams[slots]
        top_k, top_p, min_p = i[:, I_TOP_K].contiguous(), f[:, F_TOP_P].contiguous(), f[:, F_MIN_P]
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
        tau_k, tau_p = tau_k.contiguous(), tau_p.contiguous()
        self.passes.threshold_fallback(z, need, top_k, top_p, tau_k, tau_p, m.contiguous())
        tau_min = torch.where(min_p > 0, m + torch.log(min_p), NEG_INF)
        return torch.maximum(torch.maximum(tau_k, tau_p), tau_min)

    def filtered_logits(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The processed logits with what the filters drop set to -inf (for tests)."""
        out = self.passes.prepare(logits, slots, self.state, write_z=True, sample=False)
        return out.z.masked_fill(out.z < self.thresholds(out, slots)[:, None], NEG_INF)

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int):
        """From the raw log-softmax: each token's log-probability and rank (1 = most likely),
        and the top alternatives' log-probabilities and ids."""
        lse = torch.logsumexp(logits, dim=1, keepdim=True)
        chosen = logits.gather(1, tokens[:, None])
        rank = (logits > chosen).sum(dim=1) + 1
        top_values, top_ids = logits.topk(top, dim=1)
        return (chosen - lse).squeeze(1), rank, top_values - lse, top_ids
