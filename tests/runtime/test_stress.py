"""1,000 requests through a KV pool so small that preemption happens hundreds of times.

Random prompt and output lengths, a third of the prompts starting with one of five long
system prompts, greedy and seeded sampling mixed, some requests aborted midway; run with
prefix caching on and off, preempting by swapping to a host pool or by recomputing, and with
the host pool off. Every completed output must equal the same request's output from
an unconstrained run (a big pool, one batch, no cache). A divergence is accepted only where
the reference's two best logits at that position differ by less than float32 noise; the test
counts and prints them. At the end every block is free and every refcount is zero."""

from __future__ import annotations

import pytest
import torch
from conftest import write_tiny_model
from stress_workload import Request, compare, make_workload, run

from nanoqwen import LLM
from nanoqwen.runtime.kv.cache import KVCache

NUM_REQUESTS = 1000
VOCAB = 512
BLOCK_SIZE = 4
SMALL_POOL = 40  # blocks: 160 tokens, room for two or three sequences at a time
HOST_POOL = 12  # host blocks: fewer than a long sequence holds, so swapping sometimes falls back
MAX_NUM_SEQS = 12
MAX_NUM_BATCHED_TOKENS = 48
# Logits of this tiny model are O(1..10); float32 noise between batch shapes is ~1e-6.
NEAR_TIE = 1e-4


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
    return make_workload(NUM_REQUESTS, VOCAB)


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

    c = compare(workload, results, expected, ref_llm, NEAR_TIE)
    stats = llm.stats()
    print(
        f"\nstress (prefix caching {'on' if caching else 'off'}, {mode}, host pool "
        f"{HOST_POOL if host else 0}): {c.compared} outputs compared, {c.aborted} aborted, "
        f"{c.skipped} skipped, {c.diverged} near-tie divergences, {stats['num_preemptions']} "
        f"preemptions ({stats['num_swaps']} swaps), prefix-cache hit rate "
        f"{stats['prefix_cache_hit_rate']:.1%} (host tier {stats['prefix_cache_host_hits']} "
        f"tokens), blocks to/from host {stats['blocks_swapped_out']}/"
        f"{stats['blocks_swapped_in']}"
    )
    assert stats["num_preemptions"] >= 200
    assert c.aborted >= 10
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
