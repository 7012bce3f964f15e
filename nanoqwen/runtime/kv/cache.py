"""The paged KV pool: per layer K and V tensors of [blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoqwen.model.config import ModelConfig
from nanoqwen.runtime.lazy_zeros import lazy_zeros


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
        k_pool = lazy_zeros(shape, dtype, device)
        v_pool = lazy_zeros(shape, dtype, device)
        return cls(
            list(k_pool.unbind(0)), list(v_pool.unbind(0)), num_blocks, block_size, k_pool, v_pool
        )
