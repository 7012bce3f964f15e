"""verify_rows over fixed logits: the tokens it keeps are distributed as the plain sampler's
(chi-square against the reference distribution), a proposal is accepted as often as the
target samples it, and the rows it drops leave no trace in the sampler's slot tables."""

from __future__ import annotations

import math

import pytest
import torch

from nanoqwen import SamplingParams
from nanoqwen.runtime.sampling.reference import ReferenceSampler
from nanoqwen.runtime.sampling.sampler import Sampler
from nanoqwen.runtime.sequence import Sequence
from nanoqwen.runtime.spec.verify import verify_rows

VOCAB = 24


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    assert counts[~support].sum() == 0, "kept a token the filters removed"
    expected = probs[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return 1.0 if dof == 0 else float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2))


def run(params: dict, n: int, proposal: list[int], row: torch.Tensor):
    seqs = [Sequence([1, 2], SamplingParams(seed=10_000 + i, max_tokens=8, **params))
            for i in range(n)]  # fmt: skip
    sampler = Sampler(frozenset({3}), VOCAB, n, torch.device("cpu"))
    sampler.admit(seqs)
    logits = row.expand(n * (1 + len(proposal)), VOCAB).contiguous()

    def sample(rows: torch.Tensor, members: list[Sequence]) -> torch.Tensor:
        slots = torch.tensor(sampler.slots(members))
        return sampler(rows, slots, sampler.filtering)

    verified = verify_rows(logits, seqs, [list(proposal)] * n, sample, sampler,
                           lambda data, dtype: torch.tensor(data, dtype=dtype))  # fmt: skip
    return seqs, sampler, verified


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.8),
        dict(temperature=1.3, top_k=6),
        dict(temperature=0.9, min_p=0.1),
    ],  # fmt: skip
    ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()),
)
def test_kept_tokens_follow_the_target_distribution(params):
    g = torch.Generator().manual_seed(3)
    row = torch.randn(VOCAB, generator=g) * 1.5
    probs = ReferenceSampler.probabilities(row[None].clone(), [
        Sequence([1, 2], SamplingParams(**params))])[0].double()  # fmt: skip
    draft = int(probs.argsort(descending=True)[1])  # likely, far from certain
    n = 4000
    _, _, verified = run(params, n, [draft], row)
    first = torch.tensor([tokens[0] for tokens in verified.tokens])
    counts = torch.bincount(first, minlength=VOCAB).double()
    assert chi_square_p(counts, probs) > 0.001
    # Accepted exactly when the target's own sample is the proposal.
    accepted = sum(len(t) == 2 for t in verified.tokens)
    assert accepted == counts[draft] == verified.num_accepted
    p = float(probs[draft])
    assert abs(accepted - n * p) < 4 * math.sqrt(n * p * (1 - p))


def test_rows_past_a_rejection_leave_counts_and_positions_as_they_were():
    row = torch.full((VOCAB,), -5.0)
    row[7] = 5.0  # greedy picks 7 at every row
    params = dict(temperature=0, repetition_penalty=1.5)  # penalties keep token counts
    seqs, sampler, verified = run(params, 2, [7, 9, 7], row)
    # Row 0 agrees with 7, row 1 samples 7 again (penalised but still far ahead), not 9.
    assert verified.tokens == [[7, 7], [7, 7]]
    assert (verified.num_proposed, verified.num_accepted) == (6, 2)
    slots = sampler.slots(seqs)
    assert sampler.state.out_pos[slots].tolist() == [2, 2]
    assert sampler.state.counts[slots][:, 7].tolist() == [2, 2]
    assert int(sampler.state.counts[slots].sum()) == 4
