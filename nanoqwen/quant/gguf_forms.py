"""Which canonical weights are exactly GGUF Q8_0 or Q5_0 blocks, their bytes in the C
kernels' layout, and the per-channel int8 copies the kernels compute (the quantized layers'
prefill matmul runs on those)."""

from __future__ import annotations

import numpy as np
import torch

from nanoqwen.kernels.cpu import gguf
from nanoqwen.quant.format import QuantizedWeight


def _blocks_of_32(w: QuantizedWeight) -> bool:
    """int8 codes in groups of 32, one float16-representable scale each, no offset: the form
    GGUF's Q8_0 and Q5_0 blocks take (nanoqwen.quant.gguf_blocks)."""
    if w.bits != 8 or w.group_size != 32 or w.offset is not None or w.q.device.type != "cpu":
        return False
    return bool(torch.equal(w.scale.half().float(), w.scale))


def is_q5_0(w: QuantizedWeight) -> bool:
    """Whether w is exactly a Q5_0 tensor: blocks of 32 with codes in -16..15."""
    return _blocks_of_32(w) and int(w.q.min()) >= -16 and int(w.q.max()) <= 15


def is_q8_0(w: QuantizedWeight) -> bool:
    """Whether w is exactly a Q8_0 tensor (which every Q5_0 tensor also is)."""
    return _blocks_of_32(w)


def pack_q5_0(w: QuantizedWeight) -> tuple[torch.Tensor, ...]:
    """(qs uint8 [N, K/32, 16], qh int32 [N, K/32], d float16 [N, K/32]): Q5_0's own bytes."""
    n, k = w.shape
    codes = (w.q.numpy().astype(np.int16) + 16).astype(np.uint8).reshape(n, k // 32, 32)
    low = codes & 15
    qs = low[..., :16] | (low[..., 16:] << 4)
    qh = np.packbits((codes >> 4) & 1, axis=-1, bitorder="little").view(np.int32)[..., 0]
    return (
        torch.from_numpy(np.ascontiguousarray(qs)),
        torch.from_numpy(np.ascontiguousarray(qh)),
        w.scale.half().contiguous(),
    )


def pack_q8_0(w: QuantizedWeight) -> tuple[torch.Tensor, ...]:
    """(qs uint8 [N, K/32, 32] = code + 128, d float16 [N, K/32])."""
    n, k = w.shape
    qs = (w.q.to(torch.int16) + 128).to(torch.uint8).view(n, k // 32, 32)
    return qs.contiguous(), w.scale.half().contiguous()


def requantize_rows(w: QuantizedWeight) -> QuantizedWeight:
    """format.requantize_per_channel of a symmetric int8 weight, in C."""
    out, row = gguf.requantize_rows(w.q, w.scale, w.group_size)
    return QuantizedWeight(out, row, None, w.shape[1], 8)


def requantize_packed(kind: str, packed: tuple[torch.Tensor, ...]) -> QuantizedWeight:
    """The per-channel int8 copy that linear.py makes of the canonical weight packed holds,
    computed from the packed blocks (GGUF tensors loaded straight into the kernels' layouts,
    nanoqwen.quant.gguf_packed, never have the canonical codes)."""
    out, row = gguf.requantize_packed(kind, packed)
    return QuantizedWeight(out, row, None, out.shape[1], 8)
