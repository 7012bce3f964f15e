"""The reference sampler: the straightforward batched implementation (full sorts, Python
lists), kept as the specification the device-resident Sampler is tested against.

Semantics: penalties (repetition over prompt and output tokens as HF, presence and
frequency over output tokens as vLLM), min_tokens bans, then temperature, top-k, top-p and
min-p in HF's warper order. Ties at a filter's boundary are all kept: top-k keeps every token
as likely as the k-th (HF's TopKLogitsWarper), top-p every token as likely as the last one
the sorted cumulative rule keeps.
"""

from __future__ import annotations

import torch

from nanoqwen.runtime.sequence import Sequence


def _column(values: list[float], like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=like.device).unsqueeze(1)


def token_counts(rows: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[len(rows), vocab] occurrence counts, built in one scatter."""
    counts = torch.zeros(len(rows), vocab, dtype=torch.float32, device=device)
    flat = [t for row in rows for t in row]
    if flat:
        row_ids = [i for i, row in enumerate(rows) for _ in row]
        index = (torch.tensor(row_ids, device=device), torch.tensor(flat, device=device))
        counts.index_put_(index, torch.ones(len(flat), device=device), accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    vocab = logits.shape[1]
    params = [s.params for s in seqs]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = token_counts([s.token_ids for s in seqs], vocab, logits.device) > 0
        penalty = _column([p.repetition_penalty for p in params], logits)
        penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits = torch.where(seen, penalized, logits)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        counts = token_counts([s.output_token_ids for s in seqs], vocab, logits.device)
        freq = _column([p.frequency_penalty for p in params], logits)
        presence = _column([p.presence_penalty for p in params], logits)
        logits = logits - freq * counts - presence * (counts > 0).float()
    return logits


def ban_stop_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_ids: frozenset[int]):
    """min_tokens: until a sequence has that many outputs, EOS and stop tokens cannot win.

    As in vLLM, EOS stays banned under ignore_eos too: the first min_tokens tokens of a
    request never contain an EOS or stop token, whatever else it asks for."""
    for i, seq in enumerate(seqs):
        p = seq.params
        if seq.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | set(eos_ids)
            banned = [t for t in banned if t < logits.shape[1]]
            if banned:
                logits[i, banned] = float("-inf")
    return logits


def filter_logits(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]):
    """Applies top-k, then top-p, then min-p (HF's warper order); masked entries become -inf."""
    vocab = logits.shape[1]
    if any(k != -1 and k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, _ = logits.sort(dim=-1, descending=True)
        k = _column([vocab if k == -1 else min(k, vocab) for k in top_k], logits, torch.int64)
        kth = sorted_logits.gather(1, k - 1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token while the mass before it is below top_p; the first always stays.
        # Rows with top_p 1 keep everything, even where rounding lifts the cumsum past 1.
        before = probs.cumsum(dim=-1) - probs
        limit = _column([p if p < 1.0 else float("inf") for p in top_p], logits)
        kept = (before < limit).sum(dim=-1, keepdim=True).clamp(min=1)
        threshold = torch.maximum(kth, sorted_logits.gather(1, kept - 1))
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if any(p > 0.0 for p in min_p):
        probs = logits.softmax(dim=-1)
        threshold = _column(min_p, logits) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def exponential_noise(
    seqs: list[Sequence], shape, device, generators: dict[int, torch.Generator]
) -> torch.Tensor:
    """One Exp(1) draw per vocabulary entry; seeded rows use their own generator, so their
    draws do not depend on what else is in the batch."""
    noise = torch.empty(shape, device=device).exponential_()
    for i, seq in enumerate(seqs):
        if seq.params.seed is not None:
            if seq.seq_id not in generators:
                generators[seq.seq_id] = torch.Generator(device=device).manual_seed(seq.params.seed)
            noise[i].exponential_(generator=generators[seq.seq_id])
    return noise


class ReferenceSampler:
    def __init__(self, eos_token_ids: frozenset[int]) -> None:
        self.eos_token_ids = eos_token_ids
        self.generators: dict[int, torch.Generator] = {}

    def processed_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Penalties and min_tokens bans applied: greedy rows take the argmax of these."""
        if any(s.params.needs_penalties for s in seqs):
            logits = apply_penalties(logits, seqs)
        if any(s.num_output_tokens < s.params.min_tokens for s in seqs):
            logits = ban_stop_tokens(logits.clone(), seqs, self.eos_token_ids)
        return logits

    @staticmethod
    def probabilities(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The distribution each row samples from, given processed logits: temperature, then
        top-k, top-p and min-p. Greedy rows get temperature 1 (their sample is unused)."""
        params = [s.params for s in seqs]
        temps = _column([p.temperature if not p.greedy else 1.0 for p in params], logits)
        logits = filter_logits(
            logits / temps,
            [p.top_k for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
        )
        return logits.softmax(dim=-1)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits: [len(seqs), vocab] float32 -> next token ids [len(seqs)]."""
        params = [s.params for s in seqs]
        logits = self.processed_logits(logits, seqs)
        greedy = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy
        probs = self.probabilities(logits, seqs)
        # argmax(p / E) with E ~ Exp(1) draws index i with probability p_i.
        sampled = (
            probs / exponential_noise(seqs, probs.shape, probs.device, self.generators)
        ).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        return torch.where(is_greedy, greedy, sampled)
