"""The stress workload and its checker, shared by the CPU stress test and its GPU twin.

Requests with random prompt and output lengths, a third of them starting with one of five
long system prompts, greedy and seeded sampling mixed, some aborted midway. `compare` checks
each output against the same request's output from a reference run: equal, or (greedy only)
diverging where the reference's two best logits differ by less than float32 noise."""

from __future__ import annotations

import random
from dataclasses import dataclass

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.sequence import Sequence

# The sampler keys a seeded request's noise by (seed, output position), so a preempted (or
# swapped) seeded request reproduces too. False would skip preempted seeded requests.
COMPARE_PREEMPTED_SEEDED = True


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    abort_at_step: int | None  # aborted when the run reaches this step, if still running


@dataclass
class Result:
    tokens: list[int]
    finish_reason: str | None
    preempted: bool


def make_workload(
    num_requests: int,
    vocab: int,
    seed: int = 0,
    system_len: tuple[int, int] = (30, 44),
    own_len: tuple[int, int] = (1, 24),
    max_tokens: tuple[int, int] = (1, 28),
    abort_steps: int = 3000,
) -> list[Request]:
    rng = random.Random(seed)
    system_prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(*system_len))] for _ in range(5)
    ]
    requests = []
    for i in range(num_requests):
        own = [rng.randrange(vocab) for _ in range(rng.randint(*own_len))]
        prompt = rng.choice(system_prompts) + own if i % 3 == 0 else own
        n = rng.randint(*max_tokens)
        if rng.random() < 0.5:
            params = SamplingParams(temperature=0, max_tokens=n)
        else:
            params = SamplingParams(temperature=0.8, max_tokens=n, seed=rng.randrange(1 << 30))
        abort = rng.randint(1, abort_steps) if rng.random() < 0.05 else None
        requests.append(Request(prompt, params, abort))
    return requests


def run(llm: LLM, requests: list[Request], aborts: bool) -> list[Result]:
    """Adds every request at once and steps the engine until all are done, aborting the
    chosen ones when their step comes."""
    seqs: list[Sequence] = [llm._add(r.prompt, r.params, detokenize=False) for r in requests]
    preempted: set[int] = set()
    preempt = llm.scheduler._preempt

    def recording_preempt(seq):
        preempted.add(seq.seq_id)
        preempt(seq)

    llm.scheduler._preempt = recording_preempt
    by_step: dict[int, list[Sequence]] = {}
    if aborts:
        for r, s in zip(requests, seqs):
            if r.abort_at_step is not None:
                by_step.setdefault(r.abort_at_step, []).append(s)
    steps = 0
    while llm.scheduler.has_unfinished():
        steps += 1
        assert steps < 200_000, "the engine does not finish"
        llm.step()
        llm.abort(by_step.pop(steps, []))
    llm.drain()
    assert all(s.is_finished for s in seqs)
    return [Result(s.output_token_ids, s.finish_reason, s.seq_id in preempted) for s in seqs]


def near_tie(llm: LLM, context: list[int], a: int, b: int, tolerance: float) -> bool:
    """Whether tokens a and b are the reference's two best candidates after context, with
    logits closer than tolerance."""
    logits = llm.runner.prompt_logits(context, last=1)[0]
    top2 = logits.topk(2)
    gap = float(top2.values[0] - top2.values[1])
    return set(top2.indices.tolist()) == {a, b} and gap < tolerance


@dataclass
class Comparison:
    compared: int = 0
    aborted: int = 0
    skipped: int = 0
    diverged: int = 0  # near-tie divergences, accepted


def compare(
    requests: list[Request],
    results: list[Result],
    expected: list[Result],
    ref_llm: LLM,
    tolerance: float,
) -> Comparison:
    """Asserts every result equals its reference (an aborted one: as far as it got)."""
    c = Comparison()
    for i, (req, got, ref) in enumerate(zip(requests, results, expected)):
        if got.finish_reason == "abort":
            c.aborted += 1
            ok = got.tokens == ref.tokens[: len(got.tokens)]
        elif req.params.seed is not None and got.preempted and not COMPARE_PREEMPTED_SEEDED:
            c.skipped += 1
            continue
        else:
            ok = got.tokens == ref.tokens and got.finish_reason == ref.finish_reason
        c.compared += 1
        if ok:
            continue
        j = next((k for k, (a, b) in enumerate(zip(got.tokens, ref.tokens)) if a != b), None)
        assert j is not None, f"request {i}: {got.tokens} vs reference {ref.tokens}"
        context = req.prompt + ref.tokens[:j]
        tie = req.params.greedy and near_tie(
            ref_llm, context, ref.tokens[j], got.tokens[j], tolerance
        )
        assert tie, (
            f"request {i} ({'greedy' if req.params.greedy else 'seeded'}, preempted: "
            f"{got.preempted}) diverges at output {j}: {got.tokens} vs reference {ref.tokens}"
        )
        c.diverged += 1
    return c
