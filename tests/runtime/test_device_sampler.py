"""The device-resident Sampler against the reference sampler: filtered sets (ties included),
sampled frequencies (chi-square), penalties and bans, and its torch, C and Triton passes
against each other (Triton in its CPU interpreter, see conftest.py)."""

from __future__ import annotations

import pytest
import torch

from nanoqwen import SamplingParams
from nanoqwen.kernels.cpu.sample import sampling_kernels
from nanoqwen.runtime.sampling import sampler as sampler_module
from nanoqwen.runtime.sampling.filter_stage import FilterStage
from nanoqwen.runtime.sampling.passes import NativePasses, TorchPasses, TritonPasses
from nanoqwen.runtime.sampling.reference import ReferenceSampler, filter_logits
from nanoqwen.runtime.sampling.sampler import Sampler
from nanoqwen.runtime.sequence import Sequence

EOS = 3


def make_seq(prompt, output=(), **params) -> Sequence:
    params.setdefault("max_tokens", 64)
    s = Sequence(list(prompt), SamplingParams(**params))
    s.token_ids.extend(output)
    return s


def make_sampler(seqs, vocab, passes="torch", capacity=None) -> tuple[Sampler, torch.Tensor]:
    sampler = Sampler(frozenset({EOS}), vocab, capacity or len(seqs), torch.device("cpu"))
    if passes == "triton":
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("the Triton interpreter runs on CPU machines; tests/gpu covers CUDA")
        sampler.passes = TritonPasses()
    elif passes == "native":
        if sampling_kernels() is None:
            pytest.skip("no C compiler here")
        sampler.passes = NativePasses()
    else:
        sampler.passes = TorchPasses()
    sampler.admit(seqs)
    return sampler, torch.tensor(sampler.slots(seqs))


def tied_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits on a coarse grid, so that many tokens tie, boundaries included."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-12, 12, (rows, vocab), generator=g).float() / 4


FILTERS = [
    dict(top_k=1),
    dict(top_k=5),
    dict(top_k=40),
    dict(top_p=0.3),
    dict(top_p=0.8),
    dict(top_p=0.999),
    dict(min_p=0.2),
    dict(top_k=20, top_p=0.8),
    dict(top_k=8, top_p=0.5, min_p=0.3),
    dict(top_p=0.7, min_p=0.05),
    dict(temperature=0.4, top_k=30, top_p=0.95),
    dict(temperature=2.0, top_p=0.6),
    dict(),
]


@pytest.mark.parametrize("passes", ["torch", "native", "triton"])
# 4 candidates: every boundary past them; 10 tiles of 32: most skipped for a small top-k;
# a union packed into 8 places: most rows' candidates do not fit and are read in place
@pytest.mark.parametrize(
    ("candidates", "tile", "compact"), [(256, 2048, 256), (4, 2048, 256), (4, 32, 256), (4, 32, 8)]
)
def test_filtered_sets_equal_the_reference_with_ties(
    monkeypatch, passes, candidates, tile, compact
):
    if passes == "triton":
        pytest.importorskip("triton")
        from nanoqwen.kernels.triton import sample as kernels
        from nanoqwen.kernels.triton import sampling_thresholds

        monkeypatch.setattr(kernels, "TILE", tile)
        monkeypatch.setattr(sampling_thresholds, "COMPACT", compact)
    elif compact != 256:
        pytest.skip("the packed union is the Triton passes'")
    monkeypatch.setattr(sampler_module, "CANDIDATES", candidates)
    vocab = 300
    params = [dict(temperature=1.0) | f for f in FILTERS]
    seqs = [make_seq([1, 2], **p) for p in params]
    sampler, slots = make_sampler(seqs, vocab, passes)
    for seed in range(1 if passes == "triton" else 3):
        logits = tied_logits(len(seqs), vocab, seed)
        ours = sampler.filtered_logits(logits, slots)
        temps = torch.tensor([[p["temperature"]] for p in params])
        ref = filter_logits(
            logits / temps,
            [s.params.top_k for s in seqs],
            [s.params.top_p for s in seqs],
            [s.params.min_p for s in seqs],
        )
        for row, p in enumerate(params):
            kept, ref_kept = torch.isfinite(ours[row]), torch.isfinite(ref[row])
            assert torch.equal(kept, ref_kept), f"{p}: {int(kept.sum())} vs {int(ref_kept.sum())}"
        torch.testing.assert_close(ours[torch.isfinite(ours)], ref[torch.isfinite(ref)])


def triton_kept_sets(params, logits):
    """The Triton passes' filtered logits for rows of these settings (temperature 1), after
    asserting that each row keeps the reference's set."""
    seqs = [make_seq([1, 2], temperature=1.0, **p) for p in params]
    sampler, slots = make_sampler(seqs, logits.shape[1], "triton")
    ours = sampler.filtered_logits(logits, slots)
    top_k = [s.params.top_k for s in seqs]
    ref = filter_logits(logits, top_k, [s.params.top_p for s in seqs], [0.0] * len(seqs))
    for row, p in enumerate(params):
        assert torch.equal(torch.isfinite(ours[row]), torch.isfinite(ref[row])), p
    return ours, sampler, slots


def test_boundaries_past_the_candidates_are_found_in_their_union_or_the_row(monkeypatch):
    """8 tiles of 128 tokens with up to 8 candidates each: a boundary past what the row's
    merged candidates tell exactly is searched among the union of all tiles' candidates
    where it lies above c (the largest tile floor: every token above c is a candidate),
    else over the whole row. Both give the reference's kept sets, and this batch takes both."""
    pytest.importorskip("triton")
    from nanoqwen.kernels.triton import sample as kernels

    cap, tile, vocab = 8, 128, 1000
    monkeypatch.setattr(sampler_module, "CANDIDATES", cap)
    monkeypatch.setattr(kernels, "TILE", tile)
    params = [dict(top_k=k) for k in (12, 24, 100, 400)]
    params += [dict(top_p=0.9), dict(top_p=0.99), dict(top_k=200, top_p=0.8)]
    params += [dict(top_k=30, top_p=0.95)]
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(5)) * 3
    ours, sampler, slots = triton_kept_sets(params, logits)
    c = kernels.filter_thresholds(logits, slots, sampler.state, cap)[2].floor.amax(dim=1)
    where = set()
    for row in range(len(params)):
        kept = torch.isfinite(ours[row])
        if int(kept.sum()) > cap:
            where.add("union" if logits[row][kept].min() > c[row] else "row")
    assert where == {"union", "row"}


@pytest.mark.parametrize("batch", ["small", "large"])
def test_a_flat_rows_nucleus_is_searched_over_the_row_by_many_programs(monkeypatch, batch):
    """Flat rows (random weights' logits) put top-p's boundary below every candidate: the
    whole row is searched, its slices measured by programs of their own (24 a row here)
    and added up round by round (4 rounds of 256 trial keys at small batches, 8 of 16 at
    large ones). The kept sets are the reference's, and rows beside them that need no
    search keep theirs."""
    pytest.importorskip("triton")
    from nanoqwen.kernels.triton import row_search

    monkeypatch.setattr(sampler_module, "CANDIDATES", 8)
    monkeypatch.setattr(row_search, "TARGET_PROGRAMS", 96)
    monkeypatch.setattr(row_search, "SMALL_BATCH", 16 if batch == "small" else 0)
    vocab = 6000
    params = [dict(top_p=0.9), dict(top_k=5), dict(top_p=0.5), dict(top_k=50, top_p=0.9)]
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(11)) * 0.5
    ours, _, _ = triton_kept_sets(params, logits)
    assert int(torch.isfinite(ours[0]).sum()) > 4000  # a nucleus of most of the row


@pytest.mark.parametrize("rounds, programs", [(1, 5), (2, 5), (5, 5), (5, 512)])
def test_a_flat_rows_draw_without_its_threshold_is_the_reference_token(
    monkeypatch, rounds, programs
):
    """A step draws a top-p row without its threshold (nucleus_draw.py): candidates from
    the Gumbel-max down, each kept or passed by the mass above it. Over 6 steps of flat
    rows, top_p 0.3 passes many first candidates (its tokens differ from the unfiltered
    draws of the same noise), and every token is the one the torch passes draw from the
    exact threshold. With one round (a measure), the last round's single program walks every
    passed row to its token; two end on finding the next candidate; five decide most rows
    before the walk. Five programs a round share the open rows' tiles out in runs that cross
    from one row to the next; 512 take one tile each."""
    pytest.importorskip("triton")
    from nanoqwen.kernels.triton import counters, nucleus_draw
    from nanoqwen.kernels.triton import sample as kernels

    monkeypatch.setattr(sampler_module, "CANDIDATES", 8)
    monkeypatch.setattr(kernels, "TILE", 256)
    monkeypatch.setattr(nucleus_draw, "ROUNDS", rounds)
    monkeypatch.setattr(nucleus_draw, "PROGRAMS", programs)
    vocab = 3000
    params = [dict(top_p=0.3), dict(top_p=0.9), dict(top_k=1000, top_p=0.3),
              dict(top_p=0.5, min_p=0.2), dict(top_k=5), dict(temperature=0)]  # fmt: skip
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(4)) * 0.5

    def steps(passes, **override):
        seqs = []
        for i, p in enumerate(params):
            seqs.append(make_seq([1, 2], **{"temperature": 1.0, **p, **override}))
            seqs[-1].sampling_seed = 200 + i
        sampler, slots = make_sampler(seqs, vocab, passes)
        return torch.stack([sampler(logits, slots, True) for _ in range(6)])

    ours = steps("triton")
    assert torch.equal(ours, steps("torch"))
    # Every row's count was left zero for the next step's rounds.
    assert not any(c.any() for c in counters._MADE[torch.device("cpu"), "nucleus draw rows"])
    unfiltered = steps("torch", top_p=1.0)
    assert int((ours[:, [0, 2]] != unfiltered[:, [0, 2]]).sum()) >= 4
    assert torch.equal(ours[:, 4:], unfiltered[:, 4:])


def test_the_filter_stage_follows_what_the_held_slots_use():
    """A batch whose filtering rows use top-p alone skips the thresholds (NUCLEUS); a held
    top-k or min-p row needs them (FULL) until its slot is released."""
    plain = [make_seq([1], temperature=0), make_seq([1], temperature=0.8, repetition_penalty=1.1)]
    sampler, _ = make_sampler(plain, 100, capacity=6)
    assert sampler.filtering is FilterStage.NONE
    nucleus = [make_seq([1], top_p=0.9), make_seq([1], temperature=0, top_p=0.5)]
    sampler.admit(nucleus)
    assert sampler.filtering is FilterStage.NUCLEUS  # the greedy row's top_p is not used
    cut = [make_seq([1], top_k=20, top_p=0.8), make_seq([1], min_p=0.1)]
    sampler.admit(cut[:1])
    assert sampler.filtering is FilterStage.FULL
    sampler.release(cut[0])
    sampler.admit(cut[1:])
    assert sampler.filtering is FilterStage.FULL
    sampler.release(cut[1])
    assert sampler.filtering is FilterStage.NUCLEUS
    for seq in nucleus:
        sampler.release(seq)
    assert sampler.filtering is FilterStage.NONE


def test_a_top_p_batch_draws_the_reference_tokens_without_thresholds(monkeypatch):
    """The NUCLEUS stage's one pass (kernels/triton/sample.py nucleus_step) draws every row,
    records those without top-p, and leaves the top-p rows to nucleus_draw.py: over 6 steps
    of flat rows, other temperatures, penalties and a greedy row among them, the tokens the
    torch passes draw from the exact thresholds, and those of the FULL stage's passes."""
    pytest.importorskip("triton")
    from nanoqwen.kernels.triton import counters
    from nanoqwen.kernels.triton import sample as kernels

    monkeypatch.setattr(kernels, "TILE", 256)
    vocab = 3000
    # Rows at temperature 1 without penalties are read from their logits (z is not written
    # for them); the others from z.
    params = [dict(top_p=0.3), dict(top_p=0.9), dict(temperature=0.7, top_p=0.3),
              dict(temperature=1.5, top_p=0.3),
              dict(top_p=0.4, repetition_penalty=1.3, presence_penalty=0.5),
              dict(temperature=0.9), dict(temperature=0)]  # fmt: skip
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(5)) * 0.5

    def steps(passes, stage):
        seqs = []
        for i, p in enumerate(params):
            seqs.append(make_seq(range(1, 40), **{"temperature": 1.0, **p}))
            seqs[-1].sampling_seed = 300 + i
        sampler, slots = make_sampler(seqs, vocab, passes)
        assert sampler.filtering is FilterStage.NUCLEUS
        return torch.stack([sampler(logits, slots, stage) for _ in range(6)])

    ours = steps("triton", FilterStage.NUCLEUS)
    assert torch.equal(ours, steps("torch", FilterStage.NUCLEUS))
    assert torch.equal(ours, steps("triton", FilterStage.FULL))
    # Every row's count was left zero for the next step's launches.
    for user in ("sampler prepare rows", "nucleus draw rows"):
        assert not any(c.any() for c in counters._MADE[torch.device("cpu"), user])


@pytest.mark.parametrize(
    "params",
    [
        [dict(temperature=0.7, top_k=20, top_p=0.8), dict(top_p=0.9), dict(top_p=0.5),
         dict(min_p=0.1), dict(temperature=0)],
        [dict(top_p=0.8), dict(top_p=0.9), dict(top_p=0.5), dict(), dict(temperature=0)],
    ],
    ids=["full", "nucleus"],
)  # fmt: skip
def test_rows_of_nan_logits_get_a_token_each_step_from_the_triton_passes(monkeypatch, params):
    """NaN logits (a warm-up's padding rows have fed the sampler such rows) still give each
    row one token inside the vocabulary a step, top-p rows drawn without their threshold
    included: no draw loops on a mass that is not a number."""
    pytest.importorskip("triton")
    from nanoqwen.kernels.triton import sample as kernels

    monkeypatch.setattr(kernels, "TILE", 128)
    vocab, calls = 1000, 2
    seqs = [make_seq([1, 2], **{"temperature": 1.0, **p}) for p in params]
    sampler, slots = make_sampler(seqs, vocab, "triton")
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(3))
    logits[:2] = float("nan")
    logits[2:, ::2] = float("nan")
    for _ in range(calls):
        tokens = sampler(logits, slots, sampler.filtering)
        assert bool(((tokens >= 0) & (tokens < vocab)).all()), tokens.tolist()
    assert sampler.state.counts[slots].sum(dim=1).tolist() == [calls] * len(params)


def test_tiles_under_the_rows_bound_are_skipped_and_the_rest_cover_its_top_k(monkeypatch):
    """20 tiles of 32 tokens, 8 candidates: for top-k k <= 8, the tiles whose max is under
    the k-th largest tile max hold none of the row's k largest and get no candidates (their
    floor is their max); the other tiles' floors stay under the k-th largest value, so the
    thresholds come from the candidates, with no search. A larger top-k skips none."""
    pytest.importorskip("triton")
    from nanoqwen.kernels.triton import sample as kernels

    cap, tile, vocab = 8, 32, 640
    monkeypatch.setattr(kernels, "TILE", tile)
    ks = [1, 3, 8, 20]
    seqs = [make_seq([1, 2], temperature=1.0, top_k=k) for k in ks]
    sampler, slots = make_sampler(seqs, vocab, "triton")
    logits = torch.randn(len(ks), vocab, generator=torch.Generator().manual_seed(9)) * 2
    z, _, parts, _ = kernels.filter_thresholds(logits, slots, sampler.state, cap)
    for row, k in enumerate(ks):
        tile_max = z[row].view(-1, tile).amax(dim=1)
        bound = tile_max.sort(descending=True).values[k - 1] if k <= cap else float("-inf")
        skipped = tile_max < bound
        assert int(skipped.sum()) == (len(tile_max) - k if k <= cap else 0), k
        assert torch.equal(parts.floor[row][skipped], tile_max[skipped])
        assert bool((parts.cand[row][skipped] == float("-inf")).all())
        if k <= cap:
            assert parts.floor[row].max() < z[row].topk(k).values[-1], k


def test_a_cpu_sampler_takes_the_c_passes_where_they_build():
    if sampling_kernels() is None:
        pytest.skip("no C compiler here")
    assert isinstance(Sampler(frozenset(), 10, 2, torch.device("cpu")).passes, NativePasses)


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([[5.0, 4.0, 4.0, 4.0, 1.0, 0.0]])
    sampler, slots = make_sampler([make_seq([1], top_k=2)], 6)
    kept = torch.isfinite(sampler.filtered_logits(logits, slots))[0]
    assert kept.tolist() == [True, True, True, True, False, False]


def test_top_p_one_leaves_the_row_untouched():
    logits = torch.randn(1, 50) * 30  # one token holds nearly all the mass
    sampler, slots = make_sampler([make_seq([1], top_p=1.0, top_k=-1)], 50)
    assert torch.isfinite(sampler.filtered_logits(logits, slots)).all()


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token the filters removed"
    expected = probs[support] * n
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2))


DISTRIBUTIONS = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.3, top_k=6),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=0.8, min_p=0.15),
    dict(temperature=0.7, top_k=20, top_p=0.8),
    dict(temperature=1.5, top_k=10, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("passes", ["torch", "native"])
@pytest.mark.parametrize("params", DISTRIBUTIONS, ids=lambda p: ",".join(map(str, p.values())))
def test_sampled_frequencies_match_the_reference_distribution(params, passes):
    """20,000 draws: 500 requests with their own seeds, 40 steps each over fixed logits."""
    vocab, requests, steps = 24, 500, 40
    g = torch.Generator().manual_seed(7)
    row = torch.randn(vocab, generator=g) * 1.5
    seqs = [make_seq([1], seed=1000 + i, **params) for i in range(requests)]
    sampler, slots = make_sampler(seqs, vocab, passes)
    logits = row.expand(requests, vocab).contiguous()
    counts = torch.zeros(vocab)
    for _ in range(steps):
        tokens = sampler(logits, slots, sampler.filtering)
        counts += torch.bincount(tokens, minlength=vocab).float()
    probs = ReferenceSampler.probabilities(row[None].clone(), seqs[:1])[0].double()
    assert chi_square_p(counts.double(), probs) > 0.001


@pytest.mark.parametrize("spread", [3.0, 40.0])
def test_torch_c_and_triton_passes_sample_the_same_tokens(spread):
    """Same state, same logits: the same processed logits and the same draws, for a batch
    that mixes every option (the counter-based noise is bit-identical in all three). At a
    spread of 40 most tokens lie too far below the best to win any draw: the C passes skip
    their noise."""
    vocab = 1200
    mixed = [
        dict(temperature=0),
        dict(temperature=0, repetition_penalty=1.3),
        dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05),
        dict(temperature=1.0, top_p=0.9),
        dict(temperature=0.6, seed=3),
        dict(temperature=1.0, min_p=0.1, min_tokens=3, presence_penalty=0.5),
        dict(temperature=0.9, top_k=100, frequency_penalty=1.0),  # past the 64 candidates
    ]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(mixed), vocab, generator=g) * spread
    logits[:, EOS] = 7 * spread  # EOS would win but for min_tokens
    tokens = {}
    for passes in ("torch", "native", "triton"):
        seqs = []
        for i, p in enumerate(mixed):
            prompt = torch.randint(0, vocab, (10 + i,), generator=torch.Generator().manual_seed(i))
            seqs.append(make_seq(prompt.tolist(), output=[5, 5][:i], **p))
            seqs[-1].sampling_seed = 100 + i
        sampler, slots = make_sampler(seqs, vocab, passes)
        tokens[passes] = [sampler(logits, slots, True).tolist() for _ in range(3)]
    assert tokens["torch"] == tokens["native"] == tokens["triton"]
    # min_tokens=3 with two outputs: one more step may not pick EOS, the next one does.
    assert tokens["torch"][0][5] != EOS and tokens["torch"][1][5] == EOS


@pytest.mark.parametrize("passes", ["torch", "native", "triton"])
@pytest.mark.parametrize("filtering", [False, True])
def test_penalties_see_the_tokens_the_passes_sampled(passes, filtering):
    """Greedy rows where each step's token is penalised below the next best: a pass that
    missed a token its own earlier step recorded, or a prompt token, picks it again. The
    tokens lie in several 32-token words of the Triton passes' maybe_seen bits."""
    vocab = 300
    order = [250, 37, 64, 5, 290, 100, 31, 32]
    logits = torch.zeros(2, vocab)
    logits[:, order] = 1.0 - 0.01 * torch.arange(len(order)).float()
    seqs = [
        make_seq([1], temperature=0, frequency_penalty=1.0),
        make_seq([250, 64], temperature=0, repetition_penalty=4.0),
    ]
    sampler, slots = make_sampler(seqs, vocab, passes)
    steps = [sampler(logits, slots, filtering).tolist() for _ in range(8)]
    assert [s[0] for s in steps] == order
    # Repetition penalties do not grow with the count: 250 (1.0 / 4) wins once all are seen.
    assert [s[1] for s in steps] == [37, 5, 290, 100, 31, 32, 250, 250]


def test_penalties_and_bans_equal_the_reference():
    vocab = 64
    g = torch.Generator().manual_seed(2)
    kinds = [
        dict(),
        dict(repetition_penalty=1.3),
        dict(repetition_penalty=0.7),
        dict(presence_penalty=0.5, frequency_penalty=0.2),
        dict(presence_penalty=-1.0, frequency_penalty=1.5, repetition_penalty=1.2),
        dict(min_tokens=4, stop_token_ids=[7, 100]),
    ]
    seqs = []
    for i, kw in enumerate(kinds):
        prompt = torch.randint(0, vocab, (5 + i,), generator=g).tolist()
        output = torch.randint(0, vocab // 4, (2 * i,), generator=g).tolist() + prompt[:2]
        seqs.append(make_seq(prompt, output, temperature=0, **kw))
    sampler, slots = make_sampler(seqs, vocab)
    logits = torch.randn(len(seqs), vocab, generator=g) * 3
    out = sampler.passes.prepare(logits, slots, sampler.state, write_z=True, sample=False)
    ref = ReferenceSampler(frozenset({EOS})).processed_logits(logits.clone(), seqs)
    assert torch.equal(out.z, ref)
    assert out.greedy.tolist() == ref.argmax(-1).tolist()


def test_logprobs_are_the_raw_log_softmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 100, generator=g) * 4
    tokens = torch.tensor([0, 17, 99, 50])
    lp, rank, top_lp, top_ids = Sampler.logprobs(logits, tokens, 5)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(lp, ref.gather(1, tokens[:, None]).squeeze(1), rtol=0, atol=1e-5)
    order = ref.argsort(dim=-1, descending=True)
    assert top_ids.tolist() == order[:, :5].tolist()
    torch.testing.assert_close(top_lp, ref.gather(1, order[:, :5]), rtol=0, atol=1e-5)
    expected_rank = [(order[r] == t).nonzero().item() + 1 for r, t in enumerate(tokens.tolist())]
    assert rank.tolist() == expected_rank


def test_slots_are_reused_and_state_reset():
    vocab = 32
    first = make_seq([4, 4, 4], temperature=0, repetition_penalty=2.0)
    sampler, slots = make_sampler([first], vocab, capacity=1)
    sampler(torch.zeros(1, vocab), slots, False)
    sampler.release(first)
    second = make_seq([9], temperature=0, repetition_penalty=2.0)
    sampler.admit([second])
    assert sampler.slots([second]) == slots.tolist()  # the one slot, handed on
    state = sampler.state
    slot = slots.item()
    assert state.prompt_mask[slot].nonzero().flatten().tolist() == [9]
    assert state.counts[slot].sum().item() == 0 and state.out_pos[slot].item() == 0
    with pytest.raises(RuntimeError, match="no sampling slot"):
        sampler.admit([make_seq([1])])
