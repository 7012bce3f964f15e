"""A GGUF tensor's rows, kept as the file's blocks and decoded when they are looked up: the
token embedding's form on the CPU.

A step reads a few rows of the embedding (one a sequence in decode, one a token in prefill),
yet decoding all of them at load, 151936 x 896 Q5_0 values in the default model, took ~0.25 s
of the CPU start and held 136 MB of int8 codes and 17 MB of scales. The blocks say the same
in 94 MB, which stay in the page cache (not in the process) until a row is read.

gguf_blocks' decoders work row by row, so rows decoded alone are bit for bit the rows of the
whole tensor decoded at once, and dequantize() of them the same lookup
(tests/quant/test_gguf_rows.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanoqwen.quant.format import QuantizedWeight
from nanoqwen.quant.gguf_blocks import BLOCK_SIZES, from_gguf_blocks

CPU = torch.device("cpu")


@dataclass(frozen=True, eq=False)  # identity: == on the arrays has no single truth value
class GGUFRows:
    """The canonical weight from_gguf_blocks(type_name, blocks) would give, a row at a time."""

    type_name: str  # one of gguf_blocks.EXACT_TYPES
    blocks: np.ndarray  # uint8 [N, bytes per row], as read_gguf gives a 2-D quantized tensor

    def __post_init__(self) -> None:
        if self.type_name not in BLOCK_SIZES:
            raise ValueError(f"{self.type_name}: allowed {', '.join(BLOCK_SIZES)}")
        _, block_bytes = BLOCK_SIZES[self.type_name]
        b = self.blocks
        if b.dtype != np.uint8 or b.ndim != 2 or b.shape[1] % block_bytes:
            raise ValueError(
                f"{self.type_name} rows must be uint8 [N, a multiple of {block_bytes} bytes], "
                f"got {b.dtype} {b.shape}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        values, block_bytes = BLOCK_SIZES[self.type_name]
        n, row_bytes = self.blocks.shape
        return n, row_bytes // block_bytes * values

    @property
    def device(self) -> torch.device:
        return CPU

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """decode().rows(index): the rows `index` (1-D; negative ids count from the end, as
        torch's indexing does), decoding nothing else."""
        ids = index.cpu().numpy()
        if ids.ndim != 1:  # decode().rows would give no 2-D QuantizedWeight either
            raise ValueError(f"row index must be 1-D, got shape {tuple(index.shape)}")
        if ids.size == 0:  # the decoders' reshapes need a row
            return from_gguf_blocks(self.type_name, self.blocks[:1]).rows(index.cpu())
        return from_gguf_blocks(self.type_name, self.blocks[ids])

    def decode(self) -> QuantizedWeight:
        """Every row, for a consumer that reads them all (a tied lm_head, a GPU's copy)."""
        return from_gguf_blocks(self.type_name, self.blocks)

    def to(self, device: torch.device | str) -> GGUFRows | QuantizedWeight:
        """Itself on the CPU; elsewhere the decoded weight, moved there (a GPU looks rows up
        in its own memory, where the step's ids are)."""
        if torch.device(device).type == "cpu":
            return self
        return self.decode().to(device)
