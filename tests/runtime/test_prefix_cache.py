"""Prefix caching in the BlockManager: content keys, refcounts, LRU eviction, hit accounting."""

from __future__ import annotations

from nanoqwen.runtime.kv import block_pool
from nanoqwen.runtime.kv.block_manager import BlockManager
from nanoqwen.runtime.sampling_params import SamplingParams
from nanoqwen.runtime.sequence import Sequence


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


def computed(bm: BlockManager, seq: Sequence) -> Sequence:
    """Admits seq and marks all of it computed, as a finished prefill would."""
    assert bm.admit(seq)
    seq.num_computed_tokens = len(seq)
    bm.register_computed(seq)
    return seq


def test_second_sequence_reuses_the_full_blocks_of_the_first():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = computed(bm, seq_of(range(10)))  # blocks [0..4) [4..8) full, [8..10) partial
    b = seq_of([*range(8), 50, 51, 52])
    assert bm.admit(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert b.num_computed_tokens == 8
    assert bm.pool.ref_count[a.block_table[0]] == 2
    assert bm.stats.queries == 10 + 11 and bm.stats.hits == 8


def test_the_last_token_is_always_computed():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    computed(bm, seq_of(range(12)))
    again = seq_of(range(12))  # all three blocks are cached, the third holds the last token
    assert bm.admit(again)
    assert again.num_computed_tokens == 8 and again.num_uncomputed_tokens == 4
    shorter = seq_of(range(9))
    assert bm.admit(shorter)
    assert shorter.num_computed_tokens == 8 and shorter.num_uncomputed_tokens == 1


def test_a_different_token_ends_the_chain():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    computed(bm, seq_of(range(16)))
    b = seq_of([0, 1, 2, 3, 4, 99, 6, 7, 8, 9, 10, 11, 12])  # differs in the second block
    computed(bm, b)
    assert b.num_computed_tokens == 13 and bm.stats.hits == 4
    # b's third block has the tokens of a's third block, but another parent: a new key.
    assert bm.pool.num_cached == 4 + 2


def test_a_prefix_being_computed_is_waited_for_not_computed_twice():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = seq_of(range(10))
    assert bm.admit(a)  # admitted, its prefill not run yet
    b = seq_of([*range(8), 70, 71])
    assert not bm.admit(b) and b.block_table == []
    assert bm.admit(seq_of([5] * 9))  # an unrelated prompt does not wait
    a.num_computed_tokens = 10
    bm.register_computed(a)
    assert bm.admit(b) and b.num_computed_tokens == 8
    # A sequence dropped before computing (preempted, aborted) leaves nothing to wait for.
    c = seq_of([9] * 12)
    assert bm.admit(c)
    bm.free(c)
    d = seq_of([9] * 12)
    assert bm.admit(d) and d.num_computed_tokens == 0


def test_hash_collisions_are_misses(monkeypatch):
    monkeypatch.setattr("nanoqwen.runtime.kv.block_manager.block_hash", lambda parent, tokens: 42)
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    computed(bm, seq_of(range(9)))
    b = seq_of([7, 7, 7, 7, 7, 7, 7, 7, 7])  # same (fake) key, other tokens
    assert bm.admit(b)
    assert b.num_computed_tokens == 0
    c = seq_of(range(9))
    assert bm.admit(c)
    assert c.num_computed_tokens == 4  # the second block's key is taken by the first


def test_freed_blocks_stay_cached_until_their_memory_is_needed():
    bm = BlockManager(6, 4, enable_prefix_caching=True)
    a = computed(bm, seq_of(range(9)))  # 3 blocks, 2 of them full
    full = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.pool.num_cached == 2
    assert all(bm.pool.ref_count[b] == 0 for b in full)
    # Empty blocks are used before cached ones: 4 of them are empty.
    other = seq_of(range(100, 116))
    assert bm.admit(other)
    assert not set(other.block_table) & set(full) and bm.pool.num_cached == 2
    bm.free(other)  # never computed: nothing of it is cached
    again = seq_of(range(9))
    assert bm.admit(again)
    assert again.block_table[:2] == full and again.num_computed_tokens == 8


def test_eviction_takes_the_least_recently_used_chain_tail_first():
    bm = BlockManager(6, 2, enable_prefix_caching=True)
    a = computed(bm, seq_of([1, 2, 3, 4, 5]))  # full: [1,2] [3,4]
    b = computed(bm, seq_of([6, 7, 8]))  # full: [6,7]
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    assert bm.pool.num_cached == 3 and bm.num_free_blocks == 6
    # 3 empty blocks: a 4-block prompt evicts one cached block, a's tail [3,4]: a was freed
    # first, and a chain is freed tail first.
    c = seq_of([9] * 8)
    assert bm.admit(c)
    assert a_blocks[1] in c.block_table and bm.pool.num_cached == 2
    bm.free(c)
    d = seq_of([1, 2, 3, 4, 5])
    assert bm.admit(d)
    assert d.num_computed_tokens == 2 and d.block_table[0] == a_blocks[0]
    e = seq_of([6, 7, 8])
    assert bm.admit(e)
    assert e.num_computed_tokens == 2 and e.block_table[0] == b_blocks[0]


def test_admission_counts_idle_cached_hits_as_used():
    bm = BlockManager(3, 4, enable_prefix_caching=True)
    a = computed(bm, seq_of(range(9)))
    bm.free(a)
    # 3 available, 2 of them are the cached hits: a 13-token prompt needs 2 more after them.
    assert not bm.admit(seq_of(range(13)))
    assert bm.num_free_blocks == 3 and bm.pool.num_cached == 2
    assert bm.admit(seq_of(range(12)))


def test_decode_blocks_are_registered_once_their_tokens_are_known():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    seq = computed(bm, seq_of(range(6)))
    seq.token_ids += [6, -1]  # a generated token, then one still in flight (placeholder)
    bm.grow(seq, 8)
    seq.num_computed_tokens = 8
    bm.register_computed(seq)
    assert bm.pool.num_cached == 1  # the second block's last token is not known yet
    seq.token_ids[-1] = 7
    bm.register_computed(seq)
    assert bm.pool.num_cached == 2
    bm.free(seq)
    again = seq_of([*range(8), 8])
    assert bm.admit(again) and again.num_computed_tokens == 8


def test_everything_returns_to_zero():
    bm = BlockManager(12, 4, enable_prefix_caching=True)
    seqs = [computed(bm, seq_of([*range(8), i])) for i in range(5)]
    shared = seqs[0].block_table[:2]
    assert [bm.pool.ref_count[b] for b in shared] == [5, 5]
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == 12 and set(bm.pool.ref_count) == {0}


def test_keys_chain_parents():
    tokens = block_pool.token_bytes([1, 2, 3])
    assert block_pool.block_hash(0, tokens) == block_pool.block_hash(0, tokens)
    assert block_pool.block_hash(0, tokens) != block_pool.block_hash(1, tokens)
    assert block_pool.block_hash(0, tokens) != block_pool.block_hash(0, tokens[:-8])


def test_off_means_no_sharing():
    bm = BlockManager(16, 4)
    a = computed(bm, seq_of(range(10)))
    b = seq_of(range(10))
    assert bm.admit(b)
    assert b.num_computed_tokens == 0 and not set(a.block_table) & set(b.block_table)
    assert bm.stats.hits == 0
