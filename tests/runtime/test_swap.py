"""The host KV pool: block copies, preemption by swapping, and the host tier of the cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.kv.block_manager import BlockManager
from nanoqwen.runtime.kv.cache import KVCache
from nanoqwen.runtime.kv.host_pool import HostKVCache, consecutive_runs
from nanoqwen.runtime.scheduler import Scheduler, SchedulerConfig
from nanoqwen.runtime.sequence import Sequence, SequenceStatus

CFG = SimpleNamespace(num_hidden_layers=3, num_key_value_heads=2, head_dim=4)


def pools(num_blocks=8, host_blocks=8, block_size=2) -> tuple[KVCache, HostKVCache]:
    kv = KVCache.allocate(CFG, num_blocks, block_size, torch.float32, "cpu")
    kv.k_pool.copy_(torch.randn_like(kv.k_pool))
    kv.v_pool.copy_(torch.randn_like(kv.v_pool))
    return kv, HostKVCache(kv, host_blocks)


def block(kv: KVCache, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kv.k_pool[:, b].clone(), kv.v_pool[:, b].clone()


def test_consecutive_runs():
    assert consecutive_runs([4, 5, 6, 1, 2, 9]) == [(0, 4, 3), (3, 1, 2), (5, 9, 1)]
    assert consecutive_runs([]) == []


@pytest.mark.parametrize("staging_bytes", [1 << 20, 1], ids=["one-batch", "block-by-block"])
def test_blocks_go_out_and_come_back_whole(monkeypatch, staging_bytes):
    monkeypatch.setattr("nanoqwen.runtime.kv.host_pool.STAGING_BYTES", staging_bytes)
    kv, host = pools()
    before = [block(kv, b) for b in (5, 2, 3)]
    host.copy_out([5, 2, 3], [0, 1, 6])  # two runs of host blocks
    kv.k_pool.zero_()
    kv.v_pool.zero_()
    host.copy_in([6, 0, 1], [7, 1, 4])
    for (k, v), b in zip(before, (1, 4, 7)):
        assert torch.equal(kv.k_pool[:, b], k) and torch.equal(kv.v_pool[:, b], v)
    assert kv.k_pool[:, [0, 2, 3, 5, 6]].abs().sum() == 0  # nothing else was written
    assert (host.blocks_out, host.blocks_in) == (3, 3)


def seq_of(n: int, max_tokens: int = 16) -> Sequence:
    return Sequence(list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))


def test_swap_out_frees_the_device_and_swap_in_restores_the_contents():
    kv, host = pools()
    bm = BlockManager(8, 2, host=host)
    seq = seq_of(5)
    assert bm.admit(seq)
    seq.num_computed_tokens = 5
    contents = [block(kv, b) for b in seq.block_table]
    assert bm.can_swap_out(seq)
    bm.swap_out(seq)
    assert seq.block_table == [] and len(seq.host_block_table) == 3
    assert bm.num_free_blocks == 8 and bm.host_pool.num_available == 5
    kv.k_pool.zero_()
    kv.v_pool.zero_()
    assert bm.swap_in_blocks(seq) == 3 and bm.can_swap_in(seq)
    bm.swap_in(seq)
    assert seq.host_block_table == [] and bm.host_pool.num_available == 8
    assert [block(kv, b)[0].tolist() for b in seq.block_table] == [k.tolist() for k, _ in contents]
    assert seq.num_computed_tokens == 5  # nothing to recompute
    bm.free(seq)
    assert bm.num_free_blocks == 8 and set(bm.pool.ref_count) == {0}


def test_swap_in_reuses_blocks_still_cached_on_the_device():
    kv, host = pools()
    bm = BlockManager(8, 2, enable_prefix_caching=True, host=host)
    seq = seq_of(5)
    assert bm.admit(seq)
    seq.num_computed_tokens = 5
    table = list(seq.block_table)
    bm.swap_out(seq)
    assert host.blocks_out == 3
    bm.swap_in(seq)
    assert seq.block_table[:2] == table[:2]  # its two full blocks, never evicted
    assert host.blocks_in == 1  # only the partial one is copied back
    bm.free(seq)
    assert set(bm.pool.ref_count) == {0} and set(bm.host_pool.ref_count) == {0}


def test_swap_needs_room_in_the_host_pool():
    kv, host = pools(host_blocks=2)
    bm = BlockManager(8, 2, host=host)
    seq = seq_of(5)
    assert bm.admit(seq)
    assert not bm.can_swap_out(seq)
    assert not BlockManager(8, 2).can_swap_out(seq)  # no host pool at all


def test_evicted_cached_blocks_move_to_the_host_tier_and_come_back():
    kv, host = pools(num_blocks=4, host_blocks=8)
    bm = BlockManager(4, 2, enable_prefix_caching=True, host=host)
    a = seq_of(7)
    assert bm.admit(a)
    a.num_computed_tokens = 7
    full = a.block_table[:3]
    contents = [block(kv, b) for b in full]
    bm.free(a)
    # Another prompt takes the whole pool: a's cached blocks are evicted to the host.
    b = Sequence([9] * 8, SamplingParams())
    assert bm.admit(b)
    assert bm.pool.num_cached == 0 and bm.host_pool.num_cached == 3
    assert host.blocks_out == 3
    kv.k_pool.zero_()
    bm.free(b)
    again = seq_of(7)
    assert bm.admit(again)
    assert again.num_computed_tokens == 6
    assert bm.stats.host_hits == 6 and bm.stats.hits == 6
    for b_id, (k, _) in zip(again.block_table[:3], contents):
        assert torch.equal(kv.k_pool[:, b_id], k)
    # Restored blocks are cached on the device again.
    assert bm.pool.num_cached == 3
    bm.free(again)
    assert set(bm.pool.ref_count) == {0} and set(bm.host_pool.ref_count) == {0}


def advance(sched: Scheduler, batch) -> None:
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        complete = batch.completes(i)
        seq.num_computed_tokens += n
        if complete:
            seq.token_ids.append(7)


def test_swapped_sequences_resume_before_new_ones_without_recomputing():
    kv, host = pools(num_blocks=3, host_blocks=8, block_size=4)
    bm = BlockManager(3, 4, host=host)
    sched = Scheduler(SchedulerConfig(preemption_mode="swap"), bm)
    a, b, c = seq_of(4), seq_of(2), seq_of(2)
    for s in (a, b, c):
        sched.add(s)
    advance(sched, sched.schedule())  # all three prefilled: the pool is full
    d = seq_of(3)
    sched.add(d)
    batch = sched.schedule()  # a needs a second block: c, the newest, is swapped out
    assert not batch.is_prefill and batch.seqs == [a, b]
    assert sched.swapped == [c] and c.status is SequenceStatus.SWAPPED
    assert (sched.num_preemptions, sched.num_swaps) == (1, 1)
    assert c.num_computed_tokens == 2 and len(c) == 3
    advance(sched, batch)
    sched.finish(b, "stop")
    batch = sched.schedule()  # c comes back (d waits) and decodes at once
    assert not batch.is_prefill and batch.seqs == [a, c] and sched.swapped == []
    assert list(sched.waiting) == [d]


def test_preemption_mode_is_checked():
    with pytest.raises(ValueError, match="preemption_mode='later' is unknown"):
        SchedulerConfig(preemption_mode="later")


def test_swap_and_recompute_give_the_same_outputs(tiny_model):
    path, _ = tiny_model
    prompts = [[(5 * i + j) % 512 for j in range(3 + i % 7)] for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for mode in ("swap", "recompute"):
        llm = LLM(str(path), block_size=2, num_kv_blocks=12, preemption_mode=mode, progress=False)
        outputs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.stats()
        assert stats["num_preemptions"] > 0
        assert (stats["num_swaps"] > 0) == (mode == "swap")
        assert llm.scheduler.blocks.num_free_blocks == 12
    assert outputs["swap"] == outputs["recompute"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_pool_starts_zeroed_aligned_and_unshared(dtype):
    """The CPU pool comes from an anonymous memory map (no up-front memset): it must still
    read as zeros, keep the layout torch.zeros gives, and its k and v must not alias."""
    kv = KVCache.allocate(CFG, 5, 4, dtype, "cpu")
    want = (CFG.num_hidden_layers, 6, 4, CFG.num_key_value_heads, CFG.head_dim)
    for pool in (kv.k_pool, kv.v_pool):
        assert pool.shape == want and pool.dtype == dtype and pool.is_contiguous()
        assert pool.data_ptr() % 64 == 0
        assert not pool.any()
    kv.k[1][2].fill_(3)
    assert int(kv.k_pool.count_nonzero()) == 4 * 2 * 4 and not kv.v_pool.any()  # block: 4 x 2 x 4
