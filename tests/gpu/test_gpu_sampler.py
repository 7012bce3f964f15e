"""The sampler's Triton passes on the GPU: filtered sets equal the reference (ties included,
boundaries past the candidates too), sampled frequencies match it, and draws equal the torch
passes' on the same device."""

from __future__ import annotations

import pytest
import torch

from nanoqwen import SamplingParams
from nanoqwen.runtime.sampling import sampler as sampler_module
from nanoqwen.runtime.sampling.filter_stage import FilterStage
from nanoqwen.runtime.sampling.passes import TorchPasses
from nanoqwen.runtime.sampling.reference import ReferenceSampler, filter_logits
from nanoqwen.runtime.sampling.sampler import Sampler
from nanoqwen.runtime.sequence import Sequence

DEV = torch.device("cuda")
VOCAB = 152064


def _sampler(params: list[dict], vocab: int = VOCAB) -> tuple[Sampler, torch.Tensor, list]:
    seqs = [Sequence([1, 2, 3], SamplingParams(max_tokens=64, **p)) for p in params]
    for i, s in enumerate(seqs):
        s.sampling_seed = 77 + i
    sampler = Sampler(frozenset({2}), vocab, len(seqs), DEV)
    sampler.admit(seqs)
    return sampler, torch.tensor(sampler.slots(seqs), device=DEV), seqs


FILTERS = [
    dict(top_k=20, top_p=0.8),
    dict(top_k=1),
    dict(top_k=1000),  # past the candidates
    dict(top_p=0.95),  # flat rows: past the candidates
    dict(top_p=0.5),
    dict(min_p=0.05),
    dict(top_k=50, top_p=0.9, min_p=0.02),
    dict(),
]


# 8 candidates: boundaries past them, searched in the union of all tiles' candidates where
# that holds them (the more tiles, the more often), else over the row.
@pytest.mark.parametrize(("candidates", "tile"), [(256, 2048), (8, 2048), (8, 256)])
def test_filtered_sets_equal_the_reference(monkeypatch, candidates, tile):
    from nanoqwen.kernels.triton import sample as kernels

    monkeypatch.setattr(sampler_module, "CANDIDATES", candidates)
    monkeypatch.setattr(kernels, "TILE", tile)
    params = [dict(temperature=0.7) | f for f in FILTERS]
    sampler, slots, seqs = _sampler(params)
    g = torch.Generator(device=DEV).manual_seed(0)
    # Coarse values: many ties, at the boundaries too.
    logits = torch.randint(-40, 40, (len(params), VOCAB), generator=g, device=DEV).float() / 8
    ours = sampler.filtered_logits(logits, slots)
    ref = filter_logits(
        logits / 0.7,
        [s.params.top_k for s in seqs],
        [s.params.top_p for s in seqs],
        [s.params.min_p for s in seqs],
    )
    for row, p in enumerate(params):
        assert torch.equal(torch.isfinite(ours[row]), torch.isfinite(ref[row])), p


# At a spread of 1 the top-p rows are flat: their boundary lies below every candidate, and
# the Triton step draws them without it (kernels/triton/nucleus_draw.py).
@pytest.mark.parametrize("spread", [4.0, 1.0])
def test_triton_and_torch_passes_draw_the_same_tokens(spread):
    params = [
        dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05),
        dict(temperature=1.0, top_p=0.9),
        dict(temperature=0.6),
        dict(temperature=1.0, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.2),
        dict(temperature=0.0, repetition_penalty=1.2),
    ] * 8
    g = torch.Generator(device=DEV).manual_seed(1)
    logits = torch.randn(len(params), VOCAB, generator=g, device=DEV) * spread
    tokens = []
    for torch_passes in (False, True):
        sampler, slots, _ = _sampler(params)
        if torch_passes:
            sampler.passes = TorchPasses()
        tokens.append(torch.stack([sampler(logits, slots, True) for _ in range(4)]))
    # Same noise bits; only log() rounding differs between the two, so near-ties may flip.
    agree = (tokens[0] == tokens[1]).float().mean().item()
    assert agree >= 0.98, agree


@pytest.mark.parametrize("spread", [4.0, 1.0])
def test_a_top_p_batch_draws_the_torch_passes_tokens_without_thresholds(spread):
    """A batch whose filtering rows use top-p alone runs the NUCLEUS stage (one pass, then
    nucleus_draw.py): the same tokens as the torch passes, and as the FULL stage's kernels."""
    params = [dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_p=0.8),
              dict(temperature=1.0, top_p=0.5, repetition_penalty=1.2),
              dict(temperature=0.6), dict(temperature=0.0)] * 8  # fmt: skip
    g = torch.Generator(device=DEV).manual_seed(2)
    logits = torch.randn(len(params), VOCAB, generator=g, device=DEV) * spread
    tokens = {}
    for name, stage in (("nucleus", FilterStage.NUCLEUS), ("full", FilterStage.FULL),
                        ("torch", FilterStage.FULL)):  # fmt: skip
        sampler, slots, _ = _sampler(params)
        assert sampler.filtering is FilterStage.NUCLEUS
        if name == "torch":
            sampler.passes = TorchPasses()
        tokens[name] = torch.stack([sampler(logits, slots, stage) for _ in range(4)])
    # The two Triton stages: the same noise and the same arithmetic on the same values.
    assert torch.equal(tokens["nucleus"], tokens["full"])
    # Same noise bits; only log() rounding differs from torch's, so near-ties may flip.
    agree = (tokens["nucleus"] == tokens["torch"]).float().mean().item()
    assert agree >= 0.98, agree


@pytest.mark.parametrize("filtering", [False, True])
def test_penalties_see_the_tokens_the_device_recorded(filtering):
    """Greedy rows where each step's token is penalised below the next best: a token missing
    from the slot's maybe_seen bits (prompt or recorded output) would be picked again. The
    vocabulary's last 32-token word is among them."""
    order = [151000, 37, 64, 5, VOCAB - 1, 100, 31, 32]
    logits = torch.zeros(2, VOCAB, device=DEV)
    logits[:, order] = 1.0 - 0.01 * torch.arange(len(order), device=DEV).float()
    seqs = [
        Sequence([1], SamplingParams(max_tokens=64, temperature=0, frequency_penalty=1.0)),
        Sequence([151000, 64], SamplingParams(max_tokens=64, temperature=0,
                                             repetition_penalty=4.0)),
    ]  # fmt: skip
    sampler = Sampler(frozenset({2}), VOCAB, len(seqs), DEV)
    sampler.admit(seqs)
    slots = torch.tensor(sampler.slots(seqs), device=DEV)
    steps = torch.stack([sampler(logits, slots, filtering) for _ in range(8)]).tolist()
    assert [s[0] for s in steps] == order
    assert [s[1] for s in steps] == [37, 5, VOCAB - 1, 100, 31, 32, 151000, 151000]


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=20, top_p=0.8),
        dict(temperature=1.0, top_p=0.7),
        dict(temperature=0.8, min_p=0.15),
    ],
    ids=str,
)
def test_sampled_frequencies_match_the_reference(params):
    vocab, requests, steps = 64, 1000, 20
    g = torch.Generator().manual_seed(7)
    row = torch.randn(vocab, generator=g) * 1.5
    sampler, slots, seqs = _sampler([params] * requests, vocab)  # seeds 77, 78, ...
    logits = row.to(DEV).expand(requests, vocab).contiguous()
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(steps):
        counts += torch.bincount(sampler(logits, slots, sampler.filtering).cpu(), minlength=vocab)
    probs = ReferenceSampler.probabilities(row[None].clone(), seqs[:1])[0].double()
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    assert float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2)) > 0.001


@pytest.mark.parametrize("filtering", list(FilterStage), ids=lambda s: s.name.lower())
def test_nan_logits_give_tokens_inside_the_vocabulary(filtering):
    """A NaN logit leaves the argmax's index unspecified (the warm-up of a decode graph once
    fed the sampler NaN rows, and it returned the vocabulary size): the token still indexes
    the slot's counts and the next embedding, so it must stay inside the vocabulary, and
    each call count exactly one token per slot."""
    vocab, calls = 1000, 3
    cut = dict(top_k=20) if filtering != FilterStage.NUCLEUS else {}
    params = [dict(temperature=0.0), dict(temperature=0.7, top_p=0.8, **cut),
              dict(temperature=1.0), dict(temperature=1.0, top_p=0.9)] * 2  # fmt: skip
    sampler, slots, _ = _sampler(params, vocab)
    logits = torch.randn(len(params), vocab, generator=torch.Generator(device=DEV).manual_seed(3),
                         device=DEV)  # fmt: skip
    logits[:4] = float("nan")
    logits[4:, ::2] = float("nan")
    for _ in range(calls):
        tokens = sampler(logits, slots, filtering)
        assert bool(((tokens >= 0) & (tokens < vocab)).all()), tokens.tolist()
    counted = sampler.state.counts[slots].sum(dim=1)
    assert counted.tolist() == [calls] * len(params)
