"""Hands out fixed-size KV-cache blocks to sequences and maps token positions to cache slots.

With prefix caching, a sequence's full blocks are registered by content once their K/V are
computed, and a new sequence starts from the longest chain of cached blocks that matches its
tokens, so only the rest of its prompt is prefilled.

With a host pool (HostKVCache), a sequence's blocks can be swapped out to host memory and
back, and cached blocks evicted from the device pool move to the host pool instead of being
lost: a later hit copies them back (the second tier of the prefix cache)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoqwen.runtime.kv.block_pool import ROOT_HASH, BlockPool, block_hash, token_bytes
from nanoqwen.runtime.sequence import Sequence

if TYPE_CHECKING:
    from nanoqwen.runtime.kv.host_pool import HostKVCache


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens of admitted sequences
    hits: int = 0  # of those, tokens whose K/V came from the cache (either tier)
    host_hits: int = 0  # of the hits, tokens copied back from the host tier

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def known_length(seq: Sequence) -> int:
    """Tokens of seq whose ids are known: a token still in flight on the device is a negative
    placeholder at the end of token_ids (see launched_step.PLACEHOLDER)."""
    n = len(seq.token_ids)
    while n and seq.token_ids[n - 1] < 0:
        n -= 1
    return n


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        host: HostKVCache | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size}: both must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.host = host
        self.host_pool = BlockPool(host.num_blocks) if host is not None else None
        self.stats = PrefixCacheStats()
        # Full prompt blocks that admitted sequences are computing now: key -> (seq id, tokens).
        self._pending: dict[int, tuple[int, bytes]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence uses (cached prefixes among them: they are given up on demand)."""
        return self.pool.num_available

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    # ---- growing and freeing --------------------------------------------------------------
    # can_grow and grow run for every running sequence at every step, where most need no
    # new block: that case returns before anything else is looked at.
    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether seq's blocks can be extended to hold num_tokens tokens in total."""
        missing = self._missing_blocks(seq, num_tokens)
        return not missing or missing <= self.pool.num_available

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        missing = self._missing_blocks(seq, num_tokens)
        if not missing:
            return
        if missing > self.pool.num_available:
            raise RuntimeError(
                f"out of KV blocks: sequence {seq.seq_id} needs {missing}, "
                f"{self.pool.num_available} free"
            )
        seq.block_table.extend(self._take(missing))

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Gives back seq's blocks past those num_tokens tokens need (taken for proposed
        tokens that were rejected: uncomputed, so never registered)."""
        keep = self.blocks_for(num_tokens)
        for block in reversed(seq.block_table[keep:]):
            self.pool.release(block)
        del seq.block_table[keep:]

    def _take(self, n: int) -> list[int]:
        """n device blocks; cached content evicted for them moves to the host tier."""
        blocks, evicted = self.pool.take(n)
        if evicted and self.host_pool is not None:
            out: list[int] = []
            to: list[int] = []
            for block, key, tokens in evicted:
                if self.host_pool.lookup(key, tokens) is not None:
                    continue  # already kept there (a swapped-out copy, say)
                if not self.host_pool.num_available:
                    break
                [host_block], _ = self.host_pool.take(1)  # drops the host tier's LRU block
                self.host_pool.register(host_block, key, tokens)
                self.host_pool.release(host_block)  # cached, unused: evictable
                out.append(block)
                to.append(host_block)
            self.host.copy_out(out, to)  # before the new owners write into these blocks
        return blocks

    def free(self, seq: Sequence) -> None:
        """Lets go of seq's blocks; its computed full blocks stay cached until needed."""
        self.register_computed(seq)
        for key in seq.block_hashes[seq.num_registered_blocks :]:
            self._drop_pending(key, seq)
        # Tail first, so a chain's last blocks are evicted before its shared beginning.
        for block in reversed(seq.block_table):
            self.pool.release(block)
        seq.block_table = []
        seq.num_registered_blocks = 0
        for block in seq.host_block_table:
            self.host_pool.release(block)
        seq.host_block_table = []

    # ---- prefix caching -------------------------------------------------------------------
    def _block_key(self, seq: Sequence, i: int) -> tuple[int, bytes]:
        """Key and token bytes of seq's i-th block, which must be full of known tokens.
        Keys depend on the tokens only, so they are kept across preemptions."""
        bs = self.block_size
        tokens = token_bytes(seq.token_ids[i * bs : (i + 1) * bs])
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
            data = tokens if j == i else token_bytes(seq.token_ids[j * bs : (j + 1) * bs])
            seq.block_hashes.append(block_hash(parent, data))
        return seq.block_hashes[i], tokens

    def register_computed(self, seq: Sequence) -> None:
        """Registers seq's blocks that are full of computed, known tokens, so later sequences
        can reuse them. Cheap when there is nothing new."""
        if (
            not self.enable_prefix_caching
            or seq.num_computed_tokens // self.block_size <= seq.num_registered_blocks
        ):
            return  # nothing new (the common case, at every step for every running sequence)
        computed = min(seq.num_computed_tokens, known_length(seq))
        full = min(computed // self.block_size, len(seq.block_table))
        for i in range(seq.num_registered_blocks, full):
            key, tokens = self._block_key(seq, i)
            self.pool.register(seq.block_table[i], key, tokens)
            self._drop_pending(key, seq)
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def _cached_prefix(self, seq: Sequence) -> list[tuple[int, int]]:
        """seq's longest cached chain of full blocks, as (device block, -1) or, for a block
        kept in the host tier only, (-1, host block). The last token is never covered, so at
        least one token is computed and gives logits."""
        if not self._may_reuse(seq):
            return []
        hits: list[tuple[int, int]] = []
        for i in range((len(seq) - 1) // self.block_size):
            key, tokens = self._block_key(seq, i)
            block = self.pool.lookup(key, tokens)
            if block is not None:
                hits.append((block, -1))
                continue
            host_block = self.host_pool.lookup(key, tokens) if self.host_pool else None
            if host_block is None:
                break
            hits.append((-1, host_block))
        return hits

    def _may_reuse(self, seq: Sequence) -> bool:
        """Prompt logprobs still to compute need every prompt position's logits: no hits
        (as in vLLM)."""
        wants_prompt_logprobs = seq.params.prompt_logprobs is not None
        pending = seq.prompt_logprobs_launched < seq.num_prompt_tokens
        return self.enable_prefix_caching and not (wants_prompt_logprobs and pending)

    def _drop_pending(self, key: int, seq: Sequence) -> None:
        entry = self._pending.get(key)
        if entry is not None and entry[0] == seq.seq_id:
            del self._pending[key]

    def _computed_elsewhere_soon(self, seq: Sequence, num_hits: int) -> bool:
        """Whether seq's first uncached block is being computed by an admitted sequence: then
        seq had better wait a step and reuse it than compute the same prefix again."""
        if not self._may_reuse(seq) or num_hits >= (len(seq) - 1) // self.block_size:
            return False
        key, tokens = self._block_key(seq, num_hits)
        entry = self._pending.get(key)
        return entry is not None and entry[1] == tokens

    def admit(self, seq: Sequence) -> bool:
        """Gives a waiting sequence all the blocks it needs, cached ones first, and marks the
        cached tokens computed. False, taking nothing, when the pool is too short or when
        another sequence is computing the next blocks of its prefix (it waits for them)."""
        hits = self._cached_prefix(seq)
        if self._computed_elsewhere_soon(seq, len(hits)):
            return False
        device_hits = [b for b, _ in hits if b >= 0]
        host_hits = [h for _, h in hits if h >= 0]
        missing = self.blocks_for(len(seq)) - len(device_hits)
        # Cached blocks nobody uses count as available, but taking them as hits uses them up.
        idle_hits = sum(self.pool.is_evictable(b) for b in device_hits)
        if missing > self.pool.num_available - idle_hits:
            return False
        for block in device_hits:
            self.pool.acquire(block)
        for block in host_hits:
            self.host_pool.acquire(block)  # so making room on the device cannot evict them
        new = self._take(missing)
        restored = iter(new[: len(host_hits)])
        seq.block_table = [b if b >= 0 else next(restored) for b, _ in hits]
        seq.block_table += new[len(host_hits) :]
        if host_hits:
            self.host.copy_in(host_hits, new[: len(host_hits)])
            for block in host_hits:
                self.host_pool.release(block)
        seq.num_registered_blocks = 0
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_cached_tokens is None:  # a recompute after preemption is not the request's
            seq.num_cached_tokens = seq.num_computed_tokens
        self.register_computed(seq)  # the restored blocks; the others are registered already
        if self.enable_prefix_caching:
            for i in range(len(hits), len(seq) // self.block_size):
                key, tokens = self._block_key(seq, i)
                self._pending.setdefault(key, (seq.seq_id, tokens))
        self.stats.queries += len(seq)
        self.stats.hits += seq.num_computed_tokens
        self.stats.host_hits += len(host_hits) * self.block_size
        return True

    # ---- swapping -------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return self.host_pool is not None and (len(seq.block_table) <= self.host_pool.num_available)

    def swap_out(self, seq: Sequence) -> None:
        """Copies seq's blocks to the host pool and frees them on the device. Its computed
        full blocks stay findable in both tiers."""
        self.register_computed(seq)
        host_blocks, _ = self.host_pool.take(len(seq.block_table))
        self.host.copy_out(seq.block_table, host_blocks)
        if self.enable_prefix_caching:
            for i in range(seq.num_registered_blocks):
                key, tokens = self._block_key(seq, i)
                self.host_pool.register(host_blocks[i], key, tokens)
        host_table = host_blocks
        self.free(seq)
        seq.host_block_table = host_table

    def swap_in_blocks(self, seq: Sequence) -> int:
        """Device blocks seq needs to come back and compute its next token."""
        return max(len(seq.host_block_table), self.blocks_for(len(seq)))

    def can_swap_in(self, seq: Sequence) -> bool:
        return self.swap_in_blocks(seq) <= self.pool.num_available

    def swap_in(self, seq: Sequence) -> None:
        """Brings seq's blocks back; leading full blocks still cached on the device are
        taken from there instead of copied."""
        host_table = seq.host_block_table
        reused: list[int] = []
        if self.enable_prefix_caching:
            computed = min(seq.num_computed_tokens, known_length(seq))
            for i in range(min(computed // self.block_size, len(host_table))):
                block = self.pool.lookup(*self._block_key(seq, i))
                if block is None:
                    break
                reused.append(block)
        for block in reused:
            self.pool.acquire(block)
        new = self._take(len(host_table) - len(reused))
        self.host.copy_in(host_table[len(reused) :], new)
        seq.block_table = reused + new
        for block in host_table:
            self.host_pool.release(block)
        seq.host_block_table = []
        seq.num_registered_blocks = len(reused)
        self.register_computed(seq)

    # ---- slots ----------------------------------------------------------------------------
    def slot(self, seq: Sequence, position: int) -> int:
        block = seq.block_table[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]
