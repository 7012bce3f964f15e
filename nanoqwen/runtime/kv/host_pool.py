"""The host KV pool beside the device pool, and the copies between them.

Host blocks are laid out block-major, [blocks, layers, block_size, kv_heads, head_dim], so
one block of every layer is one contiguous region: a batch of blocks moves as one gather on
the device and a few large copies (one per run of consecutive host blocks). On CUDA the host
pool is pinned and the copies run on a side stream; the compute stream waits for them before
its next kernel, so no step reads a block before it arrives or overwrites one before it has
left. Without CUDA it is plain memory and the copies are synchronous."""

from __future__ import annotations

import torch

from nanoqwen.runtime.kv.cache import KVCache

# Blocks move in batches of at most this many bytes, so the device-side staging buffer of a
# long sequence's swap stays small next to the memory the KV pool was sized to leave free.
STAGING_BYTES = 64 << 20


def consecutive_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in ids, first id, length) for each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            pos, first, n = runs[-1]
            runs[-1] = (pos, first, n + 1)
        else:
            runs.append((i, b, 1))
    return runs


class HostKVCache:
    def __init__(self, device_cache: KVCache, num_blocks: int) -> None:
        self.device_cache = device_cache
        self.num_blocks = num_blocks
        pool = device_cache.k_pool
        self.device = pool.device
        self._cuda = self.device.type == "cuda"
        layers, _, block_size, heads, dim = pool.shape
        shape = (num_blocks, layers, block_size, heads, dim)
        # torch.empty: pages are committed only when a block is first written.
        self.k = torch.empty(shape, dtype=pool.dtype, pin_memory=self._cuda)
        self.v = torch.empty(shape, dtype=pool.dtype, pin_memory=self._cuda)
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        block_bytes = self.k[0].numel() * self.k.element_size()
        self._batch = max(1, STAGING_BYTES // block_bytes)
        self.blocks_out = 0  # device -> host block copies so far
        self.blocks_in = 0

    def _index(self, ids: list[int]) -> torch.Tensor:
        t = torch.tensor(ids, dtype=torch.int64, pin_memory=self._cuda)
        return t.to(self.device, non_blocking=True)

    def _on_side_stream(self, copy, *args) -> None:
        if self._stream is None:
            copy(*args)
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # the blocks' last writes are queued there
        with torch.cuda.stream(self._stream):
            copy(*args)
        compute.wait_stream(self._stream)

    def copy_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        """Device blocks -> host blocks, all layers, K and V."""
        for i in range(0, len(device_blocks), self._batch):
            dev, host = device_blocks[i : i + self._batch], host_blocks[i : i + self._batch]
            self._on_side_stream(self._copy_out, dev, host)
        self.blocks_out += len(device_blocks)

    def copy_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Host blocks -> device blocks, all layers, K and V."""
        for i in range(0, len(device_blocks), self._batch):
            host, dev = host_blocks[i : i + self._batch], device_blocks[i : i + self._batch]
            self._on_side_stream(self._copy_in, host, dev)
        self.blocks_in += len(device_blocks)

    def _pairs(self):
        return (self.device_cache.k_pool, self.k), (self.device_cache.v_pool, self.v)

    def _copy_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        index = self._index(device_blocks)
        for pool, host in self._pairs():
            staged = pool.index_select(1, index).transpose(0, 1).contiguous()
            for pos, first, n in consecutive_runs(host_blocks):
                host[first : first + n].copy_(staged[pos : pos + n], non_blocking=True)

    def _copy_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        index = self._index(device_blocks)
        for pool, host in self._pairs():
            shape = (len(host_blocks), *host.shape[1:])
            staged = torch.empty(shape, dtype=host.dtype, device=self.device)
            for pos, first, n in consecutive_runs(host_blocks):
                staged[pos : pos + n].copy_(host[first : first + n], non_blocking=True)
            pool.index_copy_(1, index, staged.transpose(0, 1))
