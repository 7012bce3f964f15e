"""The paged KV pool: per layer K and V tensors of [blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from nanoqwen.weights.config import ModelConfig


@dataclass
class KVCache:
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    num_blocks: int  # usable by sequences; one more, the scratch block, sits past them
    block_size: int
    # All layers in one tensor each, [layers, blocks + 1, block_size, kv_heads, head_dim]:
    # k and v are its per-layer views. Swapping moves a block of every layer at once.
    k_pool: torch.Tensor | None = None
    v_pool: torch.Tensor | None = None

    @property
    def scratch_block(self) -> int:
        """Padding rows of a captured batch write here, never into a live sequence's block."""
        return self.num_blocks

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * block_size * cfg.kv_size * elem

    @classmethod
    def allocate(
        cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device
    ) -> KVCache:
        shape = (
            cfg.num_hidden_layers,
            num_blocks + 1,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        # One allocation for all layers keeps the pool contiguous and the count exact.
        k_pool = _zeros(shape, dtype, device)
        v_pool = _zeros(shape, dtype, device)
        return cls(
            list(k_pool.unbind(0)), list(v_pool.unbind(0)), num_blocks, block_size, k_pool, v_pool
        )


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros, but on the CPU from a private anonymous memory map: the OS zero-fills
    its pages on first touch, so a pool of gigabytes costs nothing until sequences use it,
    where torch.zeros writes every byte first (~1.3 s of a CPU `nanoqwen generate`'s start
    for the default 1 GiB pool). Not numpy's zeros (calloc), which did the same but whose
    pages took ~20x longer to touch first on the 2-core CI machine (24 x 64 KB: 7 against
    0.4 ms): ~250 of the ~320 ms of the default model's first request."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    # Page-aligned; the tensor keeps the map alive (torch.frombuffer holds a reference).
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)
