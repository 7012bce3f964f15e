"""Sampler: picks each row's next token on the device, with no host sync and no per-step host
data but the rows' slot ids, so the whole of it is captured in the decode CUDA graphs.

Per row (the semantics of reference.py, HF's order):
1. processed logits z: penalties from the slot's token tables, min_tokens bans, temperature
   (greedy rows: temperature 1, and their token is the argmax of z);
2. top-k, top-p and min-p each keep the tokens of z above a threshold, so together they keep
   z >= tau with tau the largest of the three. top-k's (and, for a row with top-k, top-p's)
   comes from the CANDIDATES most likely tokens, merged from each vocabulary tile's values
   above a floor (no sort of the row; only tiles that can hold the k largest take part); a
   boundary past them is searched over the union of the tiles' candidates where that holds
   it, else over the row. min-p's is closed-form: z >= max(z) + log(min_p);
3. a Gumbel-max draw over the kept tokens, with counter-based noise keyed by (seed, output
   position, token): a seeded request's tokens do not depend on its batch. A row whose
   top-p threshold is not known (no top-k, or a nucleus past the candidates) is drawn
   without it (kernels/triton/nucleus_draw.py): the draw over the other filters' tokens is
   kept while the mass above it stays under top_p, else the next candidate above it is
   tried, which picks the same token as the threshold would.
Batches with no filtering row skip step 2 and draw in the same pass as step 1; batches whose
filtering rows use top-p alone (what most OpenAI clients send) skip it too, and their top-p
rows are drawn without the threshold (FilterStage.NUCLEUS).
"""

from __future__ import annotations

import torch

from nanoqwen.kernels.cpu.sample import MAX_CANDIDATES, sampling_kernels
from nanoqwen.runtime.sampling.filter_stage import FilterStage
from nanoqwen.runtime.sampling.passes import NativePasses, TorchPasses, TritonPasses
from nanoqwen.runtime.sampling.state import SamplingState
from nanoqwen.runtime.sequence import Sequence

# Values the filter thresholds are read from; each vocabulary tile contributes its largest
# CANDIDATES, so this must be a power of two (a larger top-k takes the whole-row path).
CANDIDATES = 64


def cpu_passes() -> NativePasses | TorchPasses:
    if CANDIDATES <= MAX_CANDIDATES and sampling_kernels() is not None:
        return NativePasses()
    return TorchPasses()


class Sampler:
    def __init__(
        self, eos_token_ids: frozenset[int], vocab: int, capacity: int, device: torch.device
    ) -> None:
        self.state = SamplingState(capacity, vocab, device, eos_token_ids)
        self.passes = TritonPasses() if device.type == "cuda" else cpu_passes()

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

    def has_slot(self, seq: Sequence) -> bool:
        return self.state.has_slot(seq)

    def slots(self, seqs: list[Sequence]) -> list[int]:
        return [self.state.slot(s) for s in seqs]

    @property
    def filtering(self) -> FilterStage:
        """The filter stage the next step needs, from what the held slots use."""
        if not self.state.any_filters:
            return FilterStage.NONE
        return FilterStage.FULL if self.state.any_cuts else FilterStage.NUCLEUS

    # ---- one step ---------------------------------------------------------------------------
    def __call__(self, logits: torch.Tensor, slots: torch.Tensor, filtering: int) -> torch.Tensor:
        """logits: [rows, vocab] float32, slots: [rows] int64 -> next tokens [rows] int64,
        with the passes of filtering (a FilterStage, or a bool: FULL or NONE). The tokens
        also count as outputs of their slots (penalties, positions)."""
        return self.passes.step(logits, slots, self.state, filtering, CANDIDATES)

    def filtered_logits(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The processed logits with what the filters drop set to -inf (for tests)."""
        return self.passes.filtered(logits, slots, self.state, CANDIDATES)

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int):
        """From the raw log-softmax: each token's log-probability and rank (1 = most likely),
        and the top alternatives' log-probabilities and ids."""
        lse = torch.logsumexp(logits, dim=1, keepdim=True)
        chosen = logits.gather(1, tokens[:, None])
        rank = (logits > chosen).sum(dim=1) + 1
        top_values, top_ids = logits.topk(top, dim=1)
        return (chosen - lse).squeeze(1), rank, top_values - lse, top_ids
