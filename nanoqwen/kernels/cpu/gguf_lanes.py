"""gguf_gemv.c's weight layout ("lanes": one block of 32 per 32-bit lane, see its header) made
from the file's arrays at load, and back (for the per-channel int8 copy, which reads the
file's). Q5_0, Q4_0, Q5_1, Q4_1 and Q8_0, and Q4_K and Q5_K, whose blocks of 32 take Q4_0's
nibble order (and Q5_0's fifth bits) first, and Q6_K, a lane a group of 16 values (LANE_KINDS);
the scales and mins stay as they are (a row's float16 d [N, K/32] is already one block a
lane; a K-quant's sc and m [N, K/256, 8 or 16] only lose their superblock axis)."""

from __future__ import annotations

import numpy as np
import torch

LANE_KINDS = ("q5_0", "q4_0", "q5_1", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k")
_HIGH_BITS = ("q5_0", "q5_1", "q5_k")  # the second array, qh int32 [N, K/32], becomes masks
_SUPERBLOCKS = ("q4_k", "q5_k")


def _groups(nb: int) -> list[tuple[int, int]]:
    """(first block, blocks) of a row's groups: 16 blocks each, the last one what is left."""
    return [(b, min(16, nb - b)) for b in range(0, nb, 16)]


def _code_lanes(qs: np.ndarray) -> np.ndarray:
    """qs [N, nb, B] (B = 16 or 32 bytes a block) as [N, nb * B]: per group of w blocks, B / 4
    vectors of w lanes, lane j of vector v = block j's bytes 4v..4v+3."""
    n, nb, size = qs.shape
    parts = [
        qs[:, b : b + w].reshape(n, w, size // 4, 4).transpose(0, 2, 1, 3).reshape(n, -1)
        for b, w in _groups(nb)
    ]
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


def _code_blocks(lanes: np.ndarray, nb: int) -> np.ndarray:
    """_code_lanes' inverse: [N, nb * B] back to [N, nb, B]."""
    n = lanes.shape[0]
    size = lanes.shape[1] // nb
    parts = [
        lanes[:, b * size : (b + w) * size].reshape(n, size // 4, w, 4).transpose(0, 2, 1, 3)
        for b, w in _groups(nb)
    ]
    return np.ascontiguousarray(np.concatenate(parts, axis=1).reshape(n, nb, size))


def _masks(qh: np.ndarray) -> np.ndarray:
    """Fifth bits qh [N, nb] (bit i: code i of the block) as int64 [N, G, 8]: bit 4j + i of
    mask s = code 4s + i of block 16g + j's."""
    n, nb = qh.shape
    g = (nb + 15) // 16
    bits = np.zeros((n, g * 16), dtype=np.uint64)
    bits[:, :nb] = qh.view(np.uint32)
    nibbles = (bits.reshape(n, g, 1, 16) >> (4 * np.arange(8, dtype=np.uint64))[:, None]) & 15
    masks = np.bitwise_or.reduce(nibbles << (4 * np.arange(16, dtype=np.uint64)), axis=-1)
    return masks.view(np.int64)


def _unmask(masks: np.ndarray, nb: int) -> np.ndarray:
    """_masks' inverse: int32 [N, nb]."""
    n, g, _ = masks.shape
    m = masks.view(np.uint64).reshape(n, g, 8, 1)
    nibbles = (m >> (4 * np.arange(16, dtype=np.uint64))) & 15  # [N, G, 8 (s), 16 (j)]
    qh = np.bitwise_or.reduce(nibbles << (4 * np.arange(8, dtype=np.uint64))[:, None], axis=2)
    return np.ascontiguousarray(qh.reshape(n, g * 16)[:, :nb].astype(np.uint32).view(np.int32))


def _k4_blocks(qs: np.ndarray) -> np.ndarray:
    """Q4_K's codes [N, S, 128] (byte 32c + l: value 64c + l in the low nibble, 64c + 32 + l
    in the high one) as blocks of 32 in Q4_0's order, [N, 8S, 16]: byte j = c[j] | c[j + 16]
    << 4."""
    n, ns, _ = qs.shape
    q = qs.reshape(n, ns, 4, 2, 16)  # chunk c, half h (values 16h..16h+15 of both blocks)
    low = (q[:, :, :, 0] & 0x0F) | (q[:, :, :, 1] << 4)  # block 2c: the low nibbles
    high = (q[:, :, :, 0] >> 4) | (q[:, :, :, 1] & 0xF0)  # block 2c + 1: the high ones
    return np.stack([low, high], axis=3).reshape(n, ns * 8, 16)


def _k4_superblocks(blocks: np.ndarray) -> np.ndarray:
    """_k4_blocks' inverse."""
    n, nb, _ = blocks.shape
    b = blocks.reshape(n, nb // 8, 4, 2, 16)
    first = (b[:, :, :, 0] & 0x0F) | (b[:, :, :, 1] << 4)  # bytes 32c + l, l < 16
    second = (b[:, :, :, 0] >> 4) | (b[:, :, :, 1] & 0xF0)  # l >= 16
    return np.ascontiguousarray(np.stack([first, second], axis=3).reshape(n, nb // 8, 128))


def _q6_k_codes(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q6_K's six-bit codes (0..63) [N, S, 256] from the file's ql [N, S, 128] (byte 64h + l:
    value 128h + l's low nibble, and 128h + 64 + l's in the high one) and qh [N, S, 64] (byte
    32h + l, bits 2t, 2t + 1: value 128h + 32t + l's top two bits)."""
    n, ns, _ = ql.shape
    low = (ql.reshape(n, ns, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8)[:, None]) & 15
    top = (qh.reshape(n, ns, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    return (low.reshape(n, ns, 2, 4, 32) | top << 4).reshape(n, ns, 256)


def _q6_k_file(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """_q6_k_codes' inverse: (ql, qh)."""
    n, ns, _ = u.shape
    h = u.reshape(n, ns, 2, 128)
    ql = (h[..., :64] & 15) | (h[..., 64:] & 15) << 4
    t = h.reshape(n, ns, 2, 4, 32) >> 4
    qh = t[:, :, :, 0] | t[:, :, :, 1] << 2 | t[:, :, :, 2] << 4 | t[:, :, :, 3] << 6
    return ql.reshape(n, ns, 128), np.ascontiguousarray(qh.reshape(n, ns, 64))


def _q6_k_lanes(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q6_K's codes as gguf_gemv.c reads them, 192 bytes a superblock (lane j: its values 16j..
    16j+15, 4 a vector): the low nibbles of vectors 0 and 2, of 1 and 3, then the top two bits
    of vectors 0-3 in bits 0-1, 2-3, 4-5, 6-7 of a byte."""
    u = _q6_k_codes(ql, qh).reshape(*ql.shape[:2], 16, 4, 4)  # lane, vector, byte
    v = [u[:, :, :, i] for i in range(4)]
    n0, n1 = (v[0] & 15) | (v[2] & 15) << 4, (v[1] & 15) | (v[3] & 15) << 4
    top = (v[0] >> 4) | (v[1] >> 4) << 2 | (v[2] >> 4) << 4 | (v[3] >> 4) << 6
    return np.ascontiguousarray(np.stack([n0, n1, top], axis=2).reshape(ql.shape[0], -1))


def _q6_k_unlanes(lanes: np.ndarray, ns: int) -> tuple[np.ndarray, np.ndarray]:
    """_q6_k_lanes' inverse: (ql, qh)."""
    b = lanes.reshape(lanes.shape[0], ns, 3, 16, 4)
    n0, n1, top = b[:, :, 0], b[:, :, 1], b[:, :, 2]
    v = [(n0 & 15) | (top & 3) << 4, (n1 & 15) | (top >> 2 & 3) << 4,
         (n0 >> 4) | (top >> 4 & 3) << 4, (n1 >> 4) | (top >> 6) << 4]  # fmt: skip
    return _q6_k_file(np.stack(v, axis=3).reshape(lanes.shape[0], ns, 256))


def to_lanes(kind: str, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The file's arrays of `kind` (gguf_packed.PackedBlocks') in gguf_gemv.c's lanes: codes
    uint8 [N, K or K/2], for Q5_0, Q5_1 and Q5_K the masks int64 [N, G, 8], the scales (and
    mins) as they were (a K-quant's sc and m [N, K/32], Q6_K's sc [N, K/16])."""
    if kind == "q6_k":
        ql, qh, sc, d = tensors
        lanes = _q6_k_lanes(ql.numpy(), qh.numpy())
        return torch.from_numpy(lanes), sc.reshape(sc.shape[0], -1).contiguous(), d
    qs, *rest = (t.numpy() for t in tensors)
    k_quant = kind in _SUPERBLOCKS
    out = [_code_lanes(_k4_blocks(qs) if k_quant else qs)]
    if kind in _HIGH_BITS:
        high = rest.pop(0)
        out.append(_masks(high.reshape(high.shape[0], -1)))
    if k_quant:
        sc, m = rest.pop(0), rest.pop(0)
        out += [np.ascontiguousarray(a.reshape(a.shape[0], -1)) for a in (sc, m)]
    return tuple(torch.from_numpy(a) for a in out) + tuple(tensors[len(tensors) - len(rest) :])


def from_lanes(kind: str, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """to_lanes' inverse: the file's arrays again."""
    if kind == "q6_k":
        lanes, sc, d = tensors
        ql, qh = _q6_k_unlanes(lanes.numpy(), d.shape[1])
        return torch.from_numpy(ql), torch.from_numpy(qh), sc.reshape(*d.shape, 16), d
    k_quant = kind in _SUPERBLOCKS
    nb = tensors[-1].shape[1] * (8 if k_quant else 1)
    lanes, *rest = (t.numpy() for t in tensors)
    blocks = _code_blocks(lanes, nb)
    out = [_k4_superblocks(blocks) if k_quant else blocks]
    if kind in _HIGH_BITS:
        high = _unmask(rest.pop(0), nb)
        out.append(high.reshape(high.shape[0], nb // 8, 8) if k_quant else high)
    if k_quant:
        out += [a.reshape(a.shape[0], nb // 8, 8) for a in (rest.pop(0), rest.pop(0))]
    return tuple(torch.from_numpy(a) for a in out) + tuple(tensors[len(tensors) - len(rest) :])
