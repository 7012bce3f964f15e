"""A pool of refcounted KV blocks whose full blocks can be found again by their content.

A full block is keyed by a hash of its parent block's key and its token ids, so equal keys
mean equal prefixes. A block whose last user lets go keeps its content and its key, and waits
in LRU order until its memory is needed: that is the prefix cache. The same class serves the
device pool and the host pool."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

ROOT_HASH = 0  # the parent key of a sequence's first block


def token_bytes(tokens: list[int]) -> bytes:
    return array("q", tokens).tobytes()


def block_hash(parent: int, tokens: bytes) -> int:
    """Key of a full block: BLAKE2b of its parent's key and its token ids."""
    digest = hashlib.blake2b(parent.to_bytes(16, "little"), digest_size=16)
    digest.update(tokens)
    return int.from_bytes(digest.digest(), "little")


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_count = array("q", bytes(8 * num_blocks))  # all zero
        # Unused blocks without content worth keeping: never used ones (blocks _fresh..end,
        # so a large host pool costs nothing up front), then freed ones. Recently freed ones
        # go to the back so a block is not immediately reused, which keeps stale-data bugs
        # visible in tests.
        self._fresh = 0
        self._empty: deque[int] = deque()
        # Unused blocks that still hold a cached prefix, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._index: dict[int, int] = {}  # key -> block
        self._key: dict[int, tuple[int, bytes]] = {}  # block -> (key, token bytes)

    @property
    def num_available(self) -> int:
        """Blocks a caller can take now: empty ones plus cached ones nobody uses."""
        return self.num_blocks - self._fresh + len(self._empty) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._index)

    def lookup(self, key: int, tokens: bytes) -> int | None:
        """The block cached under key, if its token ids really are `tokens`."""
        block = self._index.get(key)
        if block is None or self._key[block][1] != tokens:
            return None  # a hash collision is a miss
        return block

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def take(self, n: int) -> tuple[list[int], list[tuple[int, int, bytes]]]:
        """n blocks, each with refcount 1, empty ones first, then the least recently used
        cached ones. Returns (blocks, evicted) where evicted lists (block, key, tokens) of
        the cached content that was dropped to make room."""
        if n > self.num_available:
            raise RuntimeError(f"out of KV blocks: {n} needed, {self.num_available} available")
        blocks: list[int] = []
        evicted: list[tuple[int, int, bytes]] = []
        while len(blocks) < n:
            if self._fresh < self.num_blocks:
                block = self._fresh
                self._fresh += 1
            elif self._empty:
                block = self._empty.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                key, tokens = self._key.pop(block)
                del self._index[key]
                evicted.append((block, key, tokens))
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks, evicted

    def acquire(self, block: int) -> None:
        """One more user of a block, which may be a cached one nobody used."""
        if self.ref_count[block] == 0:
            del self._evictable[block]
        self.ref_count[block] += 1

    def release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] < 0:
            raise RuntimeError(f"block {block} released more often than taken")
        if self.ref_count[block] == 0:
            if block in self._key:
                self._evictable[block] = None  # most recently used end
            else:
                self._empty.append(block)

    def register(self, block: int, key: int, tokens: bytes) -> bool:
        """Makes a full, computed block findable under key. False when another block already
        holds that content (this one then stays private and is emptied when released)."""
        if key in self._index or block in self._key:
            return False
        self._index[key] = block
        self._key[block] = (key, tokens)
        return True
