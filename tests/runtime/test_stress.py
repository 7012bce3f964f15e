"""1,000 requests through a KV pool so small that preemption happens hundreds of times.

Random prompt and output lengths, a third of the prompts starting with one of five long
system prompts, greedy and seeded sampling mixed, some requests aborted midway; run with
prefix caching on and off, preempting by swapping to a host pool or by recomputing, and with
the host pool off. Every completed output must equal the same request's output from
an unconstrained run (a big pool, one batch, no cache). A divergence is accepted only where
the reference's two best logits at that position differ by less than float32 noise; the test
counts and prints them. At the end every block is free and every refcount is zero."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from conftest import write_tiny_model

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.kv_cache import KVCache
from nanoqwen.runtime.sequence import Sequence

NUM_REQUESTS = 1000
VOCAB = 512
BLOCK_SIZE = 4
SMALL_POOL = 40  # blocks: 160 tokens, room for two or three sequences at a time
HOST_POOL = 24  # host blocks: fewer than the device pool, so swapping sometimes falls back
MAX_NUM_SEQS = 12
MAX_NUM_BATCHED_TOKENS = 48
# Logits of this tiny model are O(1..10); float32 noise between batch shapes is ~1e-6.
NEAR_TIE = 1e-4
# Today's sampler draws a seeded request's noise from a torch.Generator on the sequence; the
# counter-based sampler keys it by (seed, output position). Set this to True to compare
# seeded requests that were preempted too.
COMPARE_PREEMPTED_SEEDED = True


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    abort_at_step: int | None  # aborted when the run reaches this step, if still running


def make_workload(seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    system_prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(30, 44))] for _ in range(5)]
    requests = []
    for i in range(NUM_REQUESTS):
        own = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 24))]
        prompt = rng.choice(system_prompts) + own if i % 3 == 0 else own
        max_tokens = rng.randint(1, 28)
        if rng.random() < 0.5:
            params = SamplingParams(temperature=0, max_tokens=max_tokens)
        else:
            params = SamplingParams(
                temperature=0.8, max_tokens=max_tokens, seed=rng.randrange(1 << 30)
            )
        abort = rng.randint(1, 3000) if rng.random() < 0.05 else None
        requests.append(Request(prompt, params, abort))
    return requests


@dataclass
class Result:
    tokens: list[int]
    finish_reason: str | None
    preempted: bool


def run(llm: LLM, requests: list[Request], aborts: bool) -> list[Result]:
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


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """This model's tensors are far too small to split across threads; on a loaded 2-core
    machine, two threads make each small op wait for the other core (20x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("stress-qwen2")
    write_tiny_model(
        path,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return str(path)


@pytest.fixture(scope="module")
def workload() -> list[Request]:
    return make_workload()


@pytest.fixture(scope="module")
def reference(checkpoint, workload):
    """Every request in one batch, in a pool that never runs short, no cache, no aborts."""
    llm = LLM(
        checkpoint,
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_REQUESTS * 96 // BLOCK_SIZE,
        max_num_seqs=NUM_REQUESTS,
        max_num_batched_tokens=1 << 16,
        max_model_len=SMALL_POOL * BLOCK_SIZE,
        enable_prefix_caching=False,
        swap_space=0,
        progress=False,
    )
    results = run(llm, workload, aborts=False)
    assert llm.scheduler.num_preemptions == 0
    return llm, results


def near_tie(llm: LLM, context: list[int], a: int, b: int) -> bool:
    """Whether tokens a and b are the reference's two best candidates after context, with
    logits closer than float32 noise."""
    logits = llm.runner.prompt_logits(context, last=1)[0]
    top2 = logits.topk(2)
    return (
        set(top2.indices.tolist()) == {a, b} and float(top2.values[0] - top2.values[1]) < NEAR_TIE
    )


@pytest.mark.parametrize(
    ("caching", "mode", "host"),
    [
        (True, "swap", True),
        (False, "swap", True),
        (True, "recompute", True),
        (False, "recompute", True),
        (True, "recompute", False),
    ],
    ids=[
        "prefix-cache-swap",
        "no-cache-swap",
        "prefix-cache-recompute-host-tier",
        "no-cache-recompute",
        "prefix-cache-recompute-no-host-pool",
    ],
)
def test_a_thousand_requests_through_a_tiny_pool(
    checkpoint, workload, reference, caching, mode, host
):
    ref_llm, expected = reference
    per_block = KVCache.bytes_per_block(ref_llm.config, BLOCK_SIZE, ref_llm.runner.kv.k[0].dtype)
    llm = LLM(
        checkpoint,
        block_size=BLOCK_SIZE,
        num_kv_blocks=SMALL_POOL,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        enable_prefix_caching=caching,
        preemption_mode=mode,
        swap_space=HOST_POOL * per_block / 2**30 if host else 0,
        progress=False,
    )
    results = run(llm, workload, aborts=True)

    compared = diverged = skipped = aborted = 0
    for i, (req, got, ref) in enumerate(zip(workload, results, expected)):
        if got.finish_reason == "abort":
            aborted += 1
            n = len(got.tokens)
            ok = got.tokens == ref.tokens[:n]
        elif req.params.seed is not None and got.preempted and not COMPARE_PREEMPTED_SEEDED:
            skipped += 1
            continue
        else:
            ok = got.tokens == ref.tokens and got.finish_reason == ref.finish_reason
        compared += 1
        if ok:
            continue
        j = next((k for k, (a, b) in enumerate(zip(got.tokens, ref.tokens)) if a != b), None)
        assert j is not None, f"request {i}: {got.tokens} vs reference {ref.tokens}"
        context = req.prompt + ref.tokens[:j]
        assert req.params.greedy and near_tie(ref_llm, context, ref.tokens[j], got.tokens[j]), (
            f"request {i} ({'greedy' if req.params.greedy else 'seeded'}, preempted: "
            f"{got.preempted}) diverges at output {j}: {got.tokens} vs reference {ref.tokens}"
        )
        diverged += 1

    stats = llm.stats()
    print(
        f"\nstress (prefix caching {'on' if caching else 'off'}, {mode}, host pool "
        f"{HOST_POOL if host else 0}): {compared} outputs compared, {aborted} aborted, "
        f"{skipped} skipped, {diverged} near-tie divergences, {stats['num_preemptions']} "
        f"preemptions ({stats['num_swaps']} swaps), prefix-cache hit rate "
        f"{stats['prefix_cache_hit_rate']:.1%} (host tier {stats['prefix_cache_host_hits']} "
        f"tokens), blocks to/from host {stats['blocks_swapped_out']}/"
        f"{stats['blocks_swapped_in']}"
    )
    assert stats["num_preemptions"] >= 200
    assert aborted >= 10
    if mode == "swap":
        assert 100 <= stats["num_swaps"] < stats["num_preemptions"]  # some fell back
    else:
        assert stats["num_swaps"] == 0
    if caching:
        assert stats["prefix_cache_hit_rate"] > 0.1
        assert (stats["prefix_cache_host_hits"] > 0) == host
    blocks = llm.scheduler.blocks
    assert blocks.num_free_blocks == SMALL_POOL
    assert set(blocks.pool.ref_count) == {0}
    if host:
        assert blocks.host_pool.num_available == HOST_POOL
        assert set(blocks.host_pool.ref_count) == {0}
    assert not llm.scheduler.has_unfinished()
