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


def _swap(a: np.ndarray, b: np.ndarray, shift: int, mask: int) -> tuple[np.ndarray, np.ndarray]:
    """a's fields under mask stay, b's move up into the others; a's others move down into
    b's fields under mask: one step of a transpose of the bit fields of a and b."""
    keep = a.dtype.type(mask)
    return (a & keep) | (b << shift & ~keep), (a >> shift & keep) | (b & ~keep)


def _code_lanes(qs: np.ndarray) -> np.ndarray:
    """qs [N, nb, B] (B = 16 or 32 bytes a block) as [N, nb * B]: per group of w blocks, B / 4
    vectors of w lanes, lane j of vector v = block j's bytes 4v..4v+3: a transpose of 32-bit
    words, the full groups in one copy (by bytes, group by group, it was ~3x slower)."""
    n, nb, size = qs.shape
    words = np.ascontiguousarray(qs).view(np.uint32)  # [N, nb, B / 4]
    v = size // 4
    lanes = np.empty((n, nb * v), dtype=np.uint32)
    full = nb // 16 * 16
    if full:
        groups = words[:, :full].reshape(n, full // 16, 16, v)
        lanes[:, : full * v].reshape(n, full // 16, v, 16)[...] = groups.transpose(0, 1, 3, 2)
    if full < nb:
        lanes[:, full * v :].reshape(n, v, nb - full)[...] = words[:, full:].transpose(0, 2, 1)
    return lanes.view(np.uint8)


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
    mask s = code 4s + i of block 16g + j's. Byte b of a block's word holds its nibbles for
    masks 2b and 2b + 1, and byte k of a mask pairs blocks 2k and 2k + 1: one swap of nibbles
    between the words of each pair of blocks, then a transpose of bytes."""
    n, nb = qh.shape
    g = (nb + 15) // 16
    bits = np.zeros((n, g * 16), dtype=np.uint32)
    bits[:, :nb] = qh.view(np.uint32)
    pairs = bits.reshape(-1, 2)  # (n, g, k); blocks 2k, 2k + 1
    masks = np.empty((n, g, 4, 2, 8), dtype=np.uint8)  # mask 2b + c, byte k
    for c, half in enumerate(_swap(pairs[:, 0], pairs[:, 1], 4, 0x0F0F0F0F)):
        masks[:, :, :, c] = half.view(np.uint8).reshape(n, g, 8, 4).transpose(0, 1, 3, 2)
    return masks.view(np.int64).reshape(n, g, 8)


def _planes(masks: np.ndarray) -> np.ndarray:
    """_masks' bits as bit planes, int64 [N, G, 8] holding 64 bytes a group: bit s of byte b
    = bit b of mask s (what an AVX2 build reads: gguf_gemv.c)."""
    n, g, _ = masks.shape
    bits = np.unpackbits(masks.view(np.uint8).reshape(n, g, 8, 8), axis=-1, bitorder="little")
    planes = np.packbits(bits.transpose(0, 1, 3, 2), axis=-1, bitorder="little")
    return np.ascontiguousarray(planes.reshape(n, g, 64)).view(np.int64)


def _unplane(planes: np.ndarray) -> np.ndarray:
    """_planes' inverse: the masks."""
    n, g, _ = planes.shape
    bits = np.unpackbits(planes.view(np.uint8).reshape(n, g, 64, 1), axis=-1, bitorder="little")
    masks = np.packbits(bits.transpose(0, 1, 3, 2), axis=-1, bitorder="little")
    return np.ascontiguousarray(masks.reshape(n, g, 64)).view(np.int64)


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
    << 4 (one swap of nibbles between bytes l and l + 16, 8 bytes at a time)."""
    n, ns, _ = qs.shape
    halves = np.ascontiguousarray(qs).view(np.uint64).reshape(-1, 2, 2)  # (n, s, c); h; 8 bytes
    blocks = np.empty((n, ns, 4, 2, 2), dtype=np.uint64)  # chunk c, block 2c / 2c + 1
    for b, half in enumerate(_swap(halves[:, 0], halves[:, 1], 4, 0x0F0F0F0F0F0F0F0F)):
        blocks[:, :, :, b] = half.reshape(n, ns, 4, 2)
    return blocks.view(np.uint8).reshape(n, ns * 8, 16)


def _k4_superblocks(blocks: np.ndarray) -> np.ndarray:
    """_k4_blocks' inverse."""
    n, nb, _ = blocks.shape
    b = blocks.reshape(n, nb // 8, 4, 2, 16)
    first, second = _swap(b[:, :, :, 0], b[:, :, :, 1], 4, 0x0F)  # bytes 32c + l, l < / >= 16
    return np.ascontiguousarray(np.stack([first, second], axis=3).reshape(n, nb // 8, 128))


def _q6_k_file(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The file's (ql [N, S, 128], qh [N, S, 64]) of Q6_K's six-bit codes u [N, S, 256]: ql's
    byte 64h + l holds value 128h + l's low nibble and 128h + 64 + l's in its high one, qh's
    byte 32h + l in bits 2t, 2t + 1 value 128h + 32t + l's top two bits."""
    n, ns, _ = u.shape
    h = u.reshape(n, ns, 2, 128)
    ql = (h[..., :64] & 15) | (h[..., 64:] & 15) << 4
    t = h.reshape(n, ns, 2, 4, 32) >> 4
    qh = t[:, :, :, 0] | t[:, :, :, 1] << 2 | t[:, :, :, 2] << 4 | t[:, :, :, 3] << 6
    return ql.reshape(n, ns, 128), np.ascontiguousarray(qh.reshape(n, ns, 64))


def _q6_k_lanes(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q6_K's codes as gguf_gemv.c reads them, 192 bytes a superblock (lane j: its values 16j..
    16j+15, 4 a vector): the low nibbles of vectors 0 and 2, of 1 and 3, then the top two bits
    of vectors 0-3 in bits 0-1, 2-3, 4-5, 6-7 of a byte. Lane j's values lie in half h = j // 8
    of ql (low nibbles for j % 8 < 4), vector i + 2 eight bytes after vector i, and their top
    bits in qh's bits 2q, 2q + 1 with q = j % 8 // 2. Bytes move 4 or 8 at a time (masks keep
    them apart), in flat arrays: numpy's many-axis loops over single bytes were 5x slower."""
    n, ns, _ = ql.shape
    # rows (n, s, h, 16-byte run J), columns vectors (0, 1) and (2, 3)
    runs = np.ascontiguousarray(ql).view(np.uint64).reshape(-1, 2)
    low, high = _swap(runs[:, 0], runs[:, 1], 4, 0x0F0F0F0F0F0F0F0F)  # lanes 8h + J / + 4 + J
    lanes = np.empty((n, ns, 3, 16), dtype=np.uint32)  # n0, n1, top; lane j's word
    nibbles = lanes[:, :, :2].reshape(n, ns, 2, 2, 2, 4)  # n0 / n1, h, low / high, J
    for c, half in enumerate((low, high)):
        words = half.view(np.uint32).reshape(n, ns, 2, 4, 2)  # h, J, n0 / n1
        nibbles[:, :, :, :, c] = words.transpose(0, 1, 4, 2, 3)
    # qh's words (n, s, h, j % 2; vector i) hold two-bit fields q = 0..3 in each byte, and lane
    # j's top byte fields i = 0..3 of field q: a 4 x 4 transpose of fields, in two swaps.
    w = np.ascontiguousarray(qh).view(np.uint32).reshape(-1, 4)
    w0, w2 = _swap(w[:, 0], w[:, 2], 4, 0x0F0F0F0F)
    w1, w3 = _swap(w[:, 1], w[:, 3], 4, 0x0F0F0F0F)
    top = lanes[:, :, 2].reshape(n, ns, 2, 4, 2)  # h, q, j % 2
    for q, word in enumerate((*_swap(w0, w1, 2, 0x33333333), *_swap(w2, w3, 2, 0x33333333))):
        top[:, :, :, q] = word.reshape(n, ns, 2, 2)
    return lanes.view(np.uint8).reshape(n, -1)


def _q6_k_unlanes(lanes: np.ndarray, ns: int) -> tuple[np.ndarray, np.ndarray]:
    """_q6_k_lanes' inverse: (ql, qh)."""
    b = lanes.reshape(lanes.shape[0], ns, 3, 16, 4)
    n0, n1, top = b[:, :, 0], b[:, :, 1], b[:, :, 2]
    v = [(n0 & 15) | (top & 3) << 4, (n1 & 15) | (top >> 2 & 3) << 4,
         (n0 >> 4) | (top >> 4 & 3) << 4, (n1 >> 4) | (top >> 6) << 4]  # fmt: skip
    return _q6_k_file(np.stack(v, axis=3).reshape(lanes.shape[0], ns, 256))


def to_lanes(
    kind: str, tensors: tuple[torch.Tensor, ...], *, planes: bool
) -> tuple[torch.Tensor, ...]:
    """The file's arrays of `kind` (gguf_packed.PackedBlocks') in gguf_gemv.c's lanes: codes
    uint8 [N, K or K/2], for Q5_0, Q5_1 and Q5_K the fifth bits int64 [N, G, 8] (masks, or
    with `planes` bit planes: gguf.fifth_bit_planes() says which the build reads), the scales
    (and mins) as they were (a K-quant's sc and m [N, K/32], Q6_K's sc [N, K/16])."""
    if kind == "q6_k":
        ql, qh, sc, d = tensors
        lanes = _q6_k_lanes(ql.numpy(), qh.numpy())
        return torch.from_numpy(lanes), sc.reshape(sc.shape[0], -1).contiguous(), d
    qs, *rest = (t.numpy() for t in tensors)
    k_quant = kind in _SUPERBLOCKS
    out = [_code_lanes(_k4_blocks(qs) if k_quant else qs)]
    if kind in _HIGH_BITS:
        high = rest.pop(0)
        masks = _masks(high.reshape(high.shape[0], -1))
        out.append(_planes(masks) if planes else masks)
    if k_quant:
        sc, m = rest.pop(0), rest.pop(0)
        out += [np.ascontiguousarray(a.reshape(a.shape[0], -1)) for a in (sc, m)]
    return tuple(torch.from_numpy(a) for a in out) + tuple(tensors[len(tensors) - len(rest) :])


def from_lanes(
    kind: str, tensors: tuple[torch.Tensor, ...], *, planes: bool
) -> tuple[torch.Tensor, ...]:
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
        bits = rest.pop(0)
        high = _unmask(_unplane(bits) if planes else bits, nb)
        out.append(high.reshape(high.shape[0], nb // 8, 8) if k_quant else high)
    if k_quant:
        out += [a.reshape(a.shape[0], nb // 8, 8) for a in (rest.pop(0), rest.pop(0))]
    return tuple(torch.from_numpy(a) for a in out) + tuple(tensors[len(tensors) - len(rest) :])
