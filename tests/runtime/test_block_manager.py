"""BlockManager: block accounting, slot mapping, and running out of blocks cleanly."""

from __future__ import annotations

import pytest

from nanoqwen.runtime.kv.block_manager import BlockManager
from nanoqwen.runtime.sampling_params import SamplingParams
from nanoqwen.runtime.sequence import Sequence


def seq_of(n: int) -> Sequence:
    return Sequence(list(range(n)), SamplingParams())


def owned_blocks(*seqs: Sequence) -> list[int]:
    return [b for s in seqs for b in s.block_table]


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4)])
def test_rejects_empty_pools(num_blocks, block_size):
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockManager(num_blocks, block_size)


def test_blocks_for_rounds_up():
    bm = BlockManager(8, 4)
    assert [bm.blocks_for(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_grow_allocates_only_missing_blocks():
    bm = BlockManager(8, 4)
    seq = seq_of(5)
    bm.grow(seq, 1)
    assert len(seq.block_table) == 1 and bm.num_free_blocks == 7
    bm.grow(seq, 4)  # still fits the first block
    assert len(seq.block_table) == 1 and bm.num_free_blocks == 7
    bm.grow(seq, 5)  # crosses into a second block
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    bm.grow(seq, 3)  # never shrinks
    assert len(seq.block_table) == 2
    bm.grow(seq, 13)
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 4
    assert len(set(seq.block_table)) == 4
    assert all(0 <= b < 8 for b in seq.block_table)


def test_sequences_never_share_blocks_and_free_returns_them_all():
    bm = BlockManager(10, 4)
    a, b, c = seq_of(9), seq_of(4), seq_of(12)
    bm.grow(a, 9)
    bm.grow(b, 4)
    bm.grow(c, 12)
    blocks = owned_blocks(a, b, c)
    assert len(blocks) == 3 + 1 + 3 == len(set(blocks))
    assert bm.num_free_blocks == 10 - 7
    bm.free(b)
    assert b.block_table == [] and bm.num_free_blocks == 4
    bm.free(a)
    bm.free(c)
    assert bm.num_free_blocks == 10
    # Freeing twice gives nothing back twice.
    bm.free(a)
    assert bm.num_free_blocks == 10
    d = seq_of(40)
    bm.grow(d, 40)
    assert sorted(d.block_table) == list(range(10))


def test_freed_blocks_are_reused_last():
    bm = BlockManager(6, 2)
    a, b = seq_of(4), seq_of(4)
    bm.grow(a, 4)
    freed = list(a.block_table)
    bm.free(a)
    bm.grow(b, 4)
    assert not set(b.block_table) & set(freed)


def test_slot_mapping_crosses_block_boundaries():
    bs = 4
    bm = BlockManager(16, bs)
    filler = seq_of(8)
    bm.grow(filler, 8)  # so the next sequence's blocks do not start at 0
    seq = seq_of(11)
    bm.grow(seq, 11)
    bm.free(filler)
    table = seq.block_table
    expected = [table[p // bs] * bs + p % bs for p in range(11)]
    assert bm.slots(seq, 0, 11) == expected
    assert [bm.slot(seq, p) for p in range(11)] == expected
    # A window that starts in one block and ends in the next.
    assert bm.slots(seq, 3, 6) == [table[0] * bs + 3, table[1] * bs, table[1] * bs + 1]
    assert bm.slots(seq, 5, 5) == []
    # Slots of different positions never collide.
    assert len(set(expected)) == 11


def test_slot_mapping_follows_a_non_contiguous_table():
    bm = BlockManager(8, 4)
    seq = seq_of(10)
    seq.block_table = [6, 1, 3]  # any physical order must be honoured
    assert bm.slots(seq, 0, 10) == [24, 25, 26, 27, 4, 5, 6, 7, 12, 13]
    assert bm.slot(seq, 9) == 13


def test_running_out_is_reported_not_crashed():
    bm = BlockManager(3, 4)
    a, b = seq_of(8), seq_of(8)
    assert bm.can_grow(a, 8)
    bm.grow(a, 8)
    assert bm.can_grow(b, 4)
    assert not bm.can_grow(b, 5)
    assert bm.can_grow(a, 12)  # a needs one more, one is free
    assert not bm.can_grow(a, 13)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow(b, 5)
    # A failed grow takes nothing.
    assert b.block_table == [] and bm.num_free_blocks == 1
    bm.grow(b, 4)
    assert bm.num_free_blocks == 0
    assert not bm.can_grow(a, 9)
    assert bm.can_grow(a, 8)  # already held: needs nothing new
