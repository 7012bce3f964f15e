"""The sampler against plain per-row references: penalties, min_tokens, temperature, top-k,
top-p, min-p, greedy; the sampled distribution; and seeded reproducibility, both in the
sampler and through the public LLM API."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.sampling.reference import ReferenceSampler as Sampler
from nanoqwen.runtime.sequence import Sequence

VOCAB = 64
EOS = 3
NEG_INF = float("-inf")


def seq(prompt=(1, 2), output=(), **params) -> Sequence:
    s = Sequence(list(prompt), SamplingParams(**params))
    s.token_ids.extend(output)
    return s


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


# ---- plain per-row references ----------------------------------------------------------------
def ref_penalties(row: torch.Tensor, s: Sequence) -> torch.Tensor:
    p = s.params
    out = row.clone()
    for t in set(s.token_ids):  # repetition: prompt and output tokens, HF semantics
        v = out[t].item()
        out[t] = v * p.repetition_penalty if v < 0 else v / p.repetition_penalty
    outputs = s.output_token_ids
    for t in set(outputs):  # presence and frequency: output tokens only
        out[t] -= p.frequency_penalty * outputs.count(t) + p.presence_penalty
    return out


def ref_top_k(row: torch.Tensor, k: int) -> torch.Tensor:
    if k == -1 or k >= row.numel():
        return row
    kth = sorted(row.tolist(), reverse=True)[k - 1]
    return torch.tensor([v if v >= kth else NEG_INF for v in row.tolist()])


def ref_top_p(row: torch.Tensor, p: float) -> torch.Tensor:
    """Keeps the most likely tokens until their mass reaches p (at least one); p = 1 is off."""
    if p >= 1.0:
        return row
    probs = row.softmax(-1).tolist()
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if mass >= p:
            break
        kept.add(i)
        mass += probs[i]
    return torch.tensor([v if i in kept else NEG_INF for i, v in enumerate(row.tolist())])


def ref_min_p(row: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = row.softmax(-1)
    top = probs.max().item()
    return torch.tensor(
        [v if probs[i].item() >= min_p * top else NEG_INF for i, v in enumerate(row.tolist())]
    )


def ref_probs(row: torch.Tensor, s: Sequence) -> torch.Tensor:
    p = s.params
    row = row / (p.temperature or 1.0)
    row = ref_min_p(ref_top_p(ref_top_k(row, p.top_k), p.top_p), p.min_p)
    return row.softmax(-1)


def assert_same_distribution(probs: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(probs == 0, ref == 0), "different tokens were filtered out"
    torch.testing.assert_close(probs, ref, rtol=1e-5, atol=1e-7)


# ---- penalties ---------------------------------------------------------------------------------
PENALTY_SEQS = [
    dict(),  # untouched row in a batch that applies penalties
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7),
    dict(presence_penalty=0.5),
    dict(frequency_penalty=0.2),
    dict(presence_penalty=-1.0, frequency_penalty=1.5, repetition_penalty=1.2),
    dict(presence_penalty=2.0, frequency_penalty=-2.0),
]


def penalty_batch():
    g = torch.Generator().manual_seed(1)
    seqs = []
    for i, kwargs in enumerate(PENALTY_SEQS):
        prompt = torch.randint(0, VOCAB, (5 + i,), generator=g).tolist()
        # Repeats inside the output, and tokens shared with the prompt.
        output = torch.randint(0, VOCAB // 4, (3 * i,), generator=g).tolist() + prompt[:2]
        seqs.append(seq(prompt, output, **kwargs))
    return seqs


def test_penalties_match_per_row_reference():
    seqs = penalty_batch()
    logits = random_logits(len(seqs))
    out = Sampler(frozenset({EOS})).processed_logits(logits.clone(), seqs)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(out[i], ref_penalties(logits[i], s), rtol=1e-6, atol=1e-6)
        untouched = [t for t in range(VOCAB) if t not in s.token_ids]
        assert torch.equal(out[i, untouched], logits[i, untouched])
    assert torch.equal(out[0], logits[0])
    # Something did change in every penalized row.
    assert all(not torch.equal(out[i], logits[i]) for i in range(1, len(seqs)))


def test_repetition_penalty_matches_hf_processor():
    seqs = [s for s in penalty_batch() if s.params.repetition_penalty != 1.0]
    logits = random_logits(len(seqs), seed=2)
    out = Sampler(frozenset()).processed_logits(logits.clone(), seqs)
    for i, s in enumerate(seqs):
        if s.params.presence_penalty or s.params.frequency_penalty:
            continue
        hf = RepetitionPenaltyLogitsProcessor(s.params.repetition_penalty)
        expected = hf(torch.tensor([s.token_ids]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(out[i], expected, rtol=0, atol=0)


def test_presence_and_frequency_ignore_prompt_tokens():
    s = seq(prompt=[5, 5, 6], output=[7, 7, 7], presence_penalty=1.0, frequency_penalty=0.5)
    logits = torch.zeros(1, VOCAB)
    out = Sampler(frozenset()).processed_logits(logits, [s])[0]
    assert out[7].item() == pytest.approx(-(1.0 + 3 * 0.5))
    assert out[5].item() == 0.0 and out[6].item() == 0.0
    assert torch.count_nonzero(out).item() == 1


# ---- min_tokens --------------------------------------------------------------------------------
def test_min_tokens_bans_eos_and_stop_token_ids_until_reached():
    """vLLM semantics: before min_tokens outputs exist, EOS and stop_token_ids cannot be
    chosen; EOS stays banned with ignore_eos=True too (vLLM keeps the model's EOS in the
    min_tokens ban list regardless of ignore_eos)."""
    stop_ids = [10, 11]
    seqs = [
        seq(output=[], min_tokens=3, stop_token_ids=stop_ids),
        seq(output=[20, 21], min_tokens=3, stop_token_ids=stop_ids),
        seq(output=[20, 21, 22], min_tokens=3, stop_token_ids=stop_ids),  # reached
        seq(output=[20], min_tokens=3, ignore_eos=True),
        seq(output=[], min_tokens=0, stop_token_ids=stop_ids),
        seq(output=[], min_tokens=2, stop_token_ids=[VOCAB + 5]),  # outside the vocab: ignored
    ]
    logits = random_logits(len(seqs))
    out = Sampler(frozenset({EOS})).processed_logits(logits.clone(), seqs)
    banned = {0: [EOS, *stop_ids], 1: [EOS, *stop_ids], 3: [EOS], 5: [EOS]}
    for i in range(len(seqs)):
        ids = banned.get(i, [])
        assert torch.all(out[i, ids] == NEG_INF)
        rest = [t for t in range(VOCAB) if t not in ids]
        assert torch.equal(out[i, rest], logits[i, rest])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_overrides_a_dominant_eos(temperature):
    sampler = Sampler(frozenset({EOS}))
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 50.0  # EOS is the only plausible token
    logits[0, 12] = 40.0  # the runner-up stop token id
    logits[0, 13] = 30.0
    for n_out in range(4):
        s = seq(output=[20] * n_out, min_tokens=3, stop_token_ids=[12], temperature=temperature)
        token = sampler(logits.clone(), [s]).item()
        assert token == (13 if n_out < 3 else EOS)


# ---- temperature / top-k / top-p / min-p ---------------------------------------------------
FILTER_SEQS = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=1.7),
    dict(top_k=-1, top_p=1.0, min_p=0.0),  # everything off, in a batch that filters
    dict(top_k=1),
    dict(top_k=5, temperature=0.8),
    dict(top_k=VOCAB),
    dict(top_k=VOCAB + 100),
    dict(top_p=1.0, temperature=0.9),
    dict(top_p=0.9),
    dict(top_p=0.5, temperature=1.3),
    dict(top_p=1e-6),
    dict(min_p=0.05),
    dict(min_p=0.3, temperature=2.0),
    dict(min_p=1.0),
    dict(top_k=10, top_p=0.8, min_p=0.1, temperature=0.7),
    dict(top_k=3, top_p=0.95),
]


def test_filters_match_per_row_reference():
    seqs = [seq(**kwargs) for kwargs in FILTER_SEQS]
    logits = random_logits(len(seqs), seed=3)
    probs = Sampler.probabilities(logits.clone(), seqs)
    for i, s in enumerate(seqs):
        assert_same_distribution(probs[i], ref_probs(logits[i], s))


def test_filters_match_hf_warpers():
    seqs = [seq(**kwargs) for kwargs in FILTER_SEQS]
    logits = random_logits(len(seqs), seed=4)
    probs = Sampler.probabilities(logits.clone(), seqs)
    for i, s in enumerate(seqs):
        p = s.params
        row = logits[i : i + 1].clone()
        ids = torch.zeros(1, 1, dtype=torch.long)
        row = TemperatureLogitsWarper(p.temperature)(ids, row)
        if p.top_k != -1:
            row = TopKLogitsWarper(min(p.top_k, VOCAB))(ids, row)
        if p.top_p < 1.0:
            row = TopPLogitsWarper(p.top_p)(ids, row)
        if p.min_p > 0.0:
            row = MinPLogitsWarper(p.min_p)(ids, row)
        assert_same_distribution(probs[i], row.softmax(-1)[0])


def test_filter_edge_cases_exactly():
    seqs = [seq(**kwargs) for kwargs in FILTER_SEQS]
    logits = random_logits(len(seqs), seed=5)
    probs = Sampler.probabilities(logits.clone(), seqs)
    by_kwargs = {tuple(sorted(k.items())): probs[i] for i, k in enumerate(FILTER_SEQS)}

    def row(**kwargs):
        return by_kwargs[tuple(sorted(kwargs.items()))], logits[FILTER_SEQS.index(kwargs)]

    # No filter at all: bit-identical to a plain softmax, whatever the other rows do.
    for kwargs in [dict(top_k=-1, top_p=1.0, min_p=0.0), dict(top_k=VOCAB)]:
        p, raw = row(**kwargs)
        assert torch.equal(p, raw.softmax(-1))
    p, raw = row(top_k=VOCAB + 100)
    assert torch.equal(p, raw.softmax(-1))
    p, raw = row(top_p=1.0, temperature=0.9)
    assert torch.equal(p, (raw / 0.9).softmax(-1))
    p, raw = row(temperature=0.5)
    assert torch.equal(p, (raw / 0.5).softmax(-1))
    # Keep-one settings leave exactly the argmax.
    for kwargs in [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)]:
        p, raw = row(**kwargs)
        assert torch.equal(p, torch.nn.functional.one_hot(raw.argmax(), VOCAB).float())
    p, _ = row(top_k=5, temperature=0.8)
    assert torch.count_nonzero(p).item() == 5


def test_greedy_rows_take_the_argmax_in_a_sampling_batch():
    torch.manual_seed(0)
    seqs = penalty_batch()  # greedy and penalized rows, mixed with sampled ones below
    for s in seqs:
        s.params = SamplingParams(
            temperature=0.0,
            repetition_penalty=s.params.repetition_penalty,
            presence_penalty=s.params.presence_penalty,
            frequency_penalty=s.params.frequency_penalty,
        )
    seqs += [seq(temperature=1.0), seq(temperature=0.7, top_k=3), seq(temperature=0.0, top_k=2)]
    logits = random_logits(len(seqs), seed=6)
    sampler = Sampler(frozenset({EOS}))
    tokens = sampler(logits.clone(), seqs)
    for i, s in enumerate(seqs):
        if s.params.greedy:
            expected = ref_penalties(logits[i], s).argmax().item()
            assert tokens[i].item() == expected
    # An all-greedy batch too.
    greedy = [seq(temperature=0.0) for _ in range(4)]
    assert torch.equal(sampler(logits[:4].clone(), greedy), logits[:4].argmax(-1))


def test_sampler_does_not_modify_its_input():
    seqs = penalty_batch() + [seq(min_tokens=2, top_k=4)]
    logits = random_logits(len(seqs), seed=7)
    before = logits.clone()
    Sampler(frozenset({EOS}))(logits, seqs)
    assert torch.equal(logits, before)


# ---- the sampled distribution ------------------------------------------------------------------
KNOWN = [0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.04, 0.01]


def renormalized(keep: list[int], probs=KNOWN) -> list[float]:
    total = sum(probs[i] for i in keep)
    return [probs[i] / total if i in keep else 0.0 for i in range(len(probs))]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(), KNOWN),
        (dict(top_k=4), renormalized([0, 1, 2, 3])),
        # Masses before each token: 0, .3, .5, .65 -> the fourth is the first past 0.6.
        (dict(top_p=0.6), renormalized([0, 1, 2])),
        # top-p sees top-k's renormalized mass: 0, .345, .575, .747 before each token.
        (dict(top_k=5, top_p=0.7), renormalized([0, 1, 2])),
        (dict(min_p=0.3), renormalized([0, 1, 2, 3, 4])),  # p >= 0.3 * 0.3
        (dict(temperature=0.5), renormalized(range(8), [p * p for p in KNOWN])),
        (dict(seed=1234, top_k=6), renormalized(range(6))),
    ],
)
def test_sampled_frequencies_match_the_renormalized_distribution(kwargs, expected):
    torch.manual_seed(0)
    n = 20_000
    s = seq(**kwargs)
    logits = torch.tensor(KNOWN).log().expand(n, -1).contiguous()
    tokens = Sampler(frozenset())(logits, [s] * n)
    counts = torch.bincount(tokens, minlength=len(KNOWN)).tolist()
    for count, p in zip(counts, expected):
        if p == 0.0:
            assert count == 0
        else:
            sigma = math.sqrt(p * (1 - p) / n)
            assert abs(count / n - p) < 5 * sigma, (counts, expected)


# ---- seeded reproducibility in the sampler -----------------------------------------------------
def draw(params_list, steps=12, seed_global=0):
    """Samples `steps` tokens for fresh sequences; returns each one's tokens."""
    torch.manual_seed(seed_global)
    seqs = [seq(**kwargs) for kwargs in params_list]
    sampler = Sampler(frozenset())
    out = [[] for _ in seqs]
    for step in range(steps):
        logits = random_logits(len(seqs), seed=100 + step) * 0.3  # high-entropy rows
        logits = logits[0:1].expand(len(seqs), -1).contiguous()  # same logits for all rows
        for i, t in enumerate(sampler(logits, seqs).tolist()):
            out[i].append(t)
            seqs[i].token_ids.append(t)
    return out


def test_seeded_rows_do_not_depend_on_their_batch():
    alone = draw([dict(seed=42)])[0]
    first = draw([dict(seed=42), dict(), dict(seed=7)], seed_global=1)[0]
    mixed = [dict(), dict(seed=7, top_k=5), dict(temperature=0.0), dict(seed=42)]
    last = draw(mixed, seed_global=2)[3]
    assert alone == first == last
    other = draw([dict(seed=43)])[0]
    assert other != alone
    # Unseeded rows follow the global generator instead.
    assert draw([dict()], seed_global=1)[0] != draw([dict()], seed_global=2)[0]


# ---- seeded reproducibility through the engine ---------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model[0]), num_kv_blocks=64, block_size=16, progress=False)


def test_seeded_request_is_reproducible_through_the_engine(llm):
    seeded = SamplingParams(temperature=1.0, seed=2024, max_tokens=12, ignore_eos=True)
    prompt = "The quick brown fox"
    alone = llm.generate([prompt], seeded)[0].token_ids
    again = llm.generate(prompt, seeded)[0].token_ids
    assert len(alone) == 12 and again == alone
    batch = llm.generate(
        ["Hello world", prompt, "import torch", prompt, "你好"],
        [
            SamplingParams(temperature=1.0, max_tokens=7),
            seeded,
            SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=15),
            SamplingParams(temperature=1.0, seed=2025, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=3),
        ],
    )
    assert batch[1].token_ids == alone
    assert batch[3].token_ids != alone  # same prompt, different seed
