"""GGUF's quantized blocks read into the canonical format without loss.

Each supported block type is integer codes times a per-group scale (plus, for Q4_K, a
per-group offset), which is exactly QuantizedWeight's form:

    Q8_0  32 codes, f16 d            -> int8, group 32, scale d
    Q5_0  32 5-bit codes, f16 d      -> int8, group 32, codes q - 16, scale d
    Q4_0  32 4-bit codes, f16 d      -> int8, group 32, codes q - 8, scale d (Q5_0's form)
    Q5_1  32 5-bit codes, f16 d, m   -> int8 (codes 0..31), group 32, scale d, offset m
    Q4_1  32 4-bit codes, f16 d, m   -> int4, group 32, scale d, offset m (Q4_K's form)
    Q6_K  256 = 16 x 16 6-bit codes  -> int8, group 16, codes q - 32, scale d * sc (int8 sc)
    Q3_K  256 = 16 x 16 3-bit codes  -> int8, group 16, codes -4..3, scale d * (sc - 32)
    Q2_K  256 = 16 x 16 2-bit codes  -> int8, group 16, codes 0..3, scale d * sc, offset
                                        -dmin * m (4-bit sc and m)
    Q4_K  256 = 8 x 32 4-bit codes   -> int4, group 32, scale d * sc, offset -dmin * m
    Q5_K  Q4_K's, a fifth bit a code -> int8 (codes 0..31), group 32, as Q4_K

The products d * sc and dmin * m are computed in float32 as ggml does, so dequantize() of the
result equals gguf.quants.dequantize bit for bit (tests/quant check this on the real file, and
on random blocks for the types it lacks).
"""

from __future__ import annotations

import numpy as np
import torch

from nanoqwen.quant.format import QuantizedWeight

QK_K = 256


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields [rows, blocks, 2] as float32 [rows, blocks]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    rows = data.shape[0]
    return data.reshape(rows, -1, block_bytes)


def _q8_0(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, None, int]:
    b = _blocks(data, 34)
    d = _f16(b[..., 0:2])
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8)
    return q.reshape(b.shape[0], -1), d, None, 32


def _q4_0(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, None, int]:
    # qs's low nibbles are values 0..15, its high ones 16..31
    b = _blocks(data, 18)
    qs = b[..., 2:18]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8) - np.int8(8)
    return q.reshape(b.shape[0], -1), _f16(b[..., 0:2]), None, 32


def _q4_1(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    b = _blocks(data, 20)  # d, m, qs [16] as Q4_0's
    qs = b[..., 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return q.reshape(b.shape[0], -1), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 32


def _q5_1(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    b = _blocks(data, 24)  # d, m, qh [4], qs [16] as Q5_0's
    qs = b[..., 8:24]
    high = np.unpackbits(b[..., 4:8], axis=-1, bitorder="little")  # bit j: value j
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | (high << 4)
    return q.view(np.int8).reshape(b.shape[0], -1), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 32


def _q5_high_table() -> np.ndarray:
    """For each qh byte, what its 8 bits add to the low nibbles of their values, Q5_0's offset
    of -16 included, mod 256: 0xF0 for a clear bit (-16), 0 for a set one (+16 - 16). As one
    uint64 a byte: one gather a qh byte, not one a value."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
    return np.where(bits == 1, 0, 0xF0).astype(np.uint8).view(np.uint64)[:, 0]


_Q5_HIGH = _q5_high_table()


def _q5_0(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, None, int]:
    b = _blocks(data, 22)
    rows, nb = b.shape[:2]
    d = _f16(b[..., 0:2])
    # Built in place in three passes (the default model's embedding is 136M codes, where the
    # plain unpackbits/concatenate/astype chain took 0.4 s): low nibbles (values 0..15 from
    # qs's low halves, 16..31 from its high ones), then high bits and offset added as bytes.
    q = np.empty((rows, nb, 32), dtype=np.uint8)
    qs = b[..., 6:22]
    np.bitwise_and(qs, 0x0F, out=q[..., :16])
    np.right_shift(qs, 4, out=q[..., 16:])
    q += _Q5_HIGH[b[..., 2:6]].view(np.uint8).reshape(rows, nb, 32)  # bit j of qh: value j
    return q.view(np.int8).reshape(rows, -1), d, None, 32


def _q6_k(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, None, int]:
    b = _blocks(data, 210)
    rows, nb = b.shape[:2]
    ql, qh = b[..., 0:128], b[..., 128:192]
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])
    # Two halves of 128 values; in each, ql's 64 bytes give the low nibbles of values 0..63
    # (low nibble) and 64..127 (high nibble), qh's 32 bytes give 2 high bits of 4 values each.
    ql = ql.reshape(rows, nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    ql = (ql & 0x0F).reshape(rows, nb, 2, 4, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    qh = (qh.reshape(rows, nb, 2, 1, 32) >> shifts) & 0x03
    q = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
    scale = d[..., None] * sc  # [rows, blocks, 16]
    return q.reshape(rows, -1), scale.reshape(rows, -1), None, 16


def q3_k_scales(s: np.ndarray) -> np.ndarray:
    """A Q3_K superblock's 12 scale bytes [..., 12] as its 16 six-bit scales minus 32
    (int8 [..., 16]): the low 4 bits of scales 0..7 and 8..15 in bytes 0..7's low and high
    nibbles, the top 2 bits in bytes 8..11, four to a byte."""
    low = np.concatenate([s[..., 0:8] & 0x0F, s[..., 0:8] >> 4], axis=-1)
    top = (s[..., 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3  # [..., 4, 4]
    high = np.swapaxes(top, -1, -2).reshape(*s.shape[:-1], 16)  # scale 4i + j: byte j, pair i
    return ((low | high << 4).astype(np.int16) - 32).astype(np.int8)


def q3_k_codes(hm: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q3_K's hmask [rows, blocks, 32] and qs [rows, blocks, 64] as int8 codes -4..3 [rows,
    blocks, 256]. In half h, value 128h + 32j + l has its low two bits at (qs[32h + l] >> 2j)
    & 3 and its third at hmask[l] bit 4h + j; code = low - 4 where that bit is clear."""
    rows, nb = hm.shape[:2]
    qs = qs.reshape(rows, nb, 2, 1, 32)
    low = (qs >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3  # [.., h, j, l]
    bits = np.unpackbits(hm[..., None], axis=-1, bitorder="little")  # [.., l, 4h + j]
    high = np.swapaxes(bits, -1, -2).reshape(rows, nb, 2, 4, 32)
    q = low.astype(np.int8) - np.int8(4) * (1 - high.astype(np.int8))
    return q.reshape(rows, nb, 256)


def q3_k_weight(hm, qs, sc, d) -> tuple[np.ndarray, np.ndarray]:
    """(codes [rows, K], scales [rows, K/16]) of Q3_K superblocks given as hmask, qs, the
    scales minus 32 (int8 [rows, blocks, 16]) and d float32 [rows, blocks]."""
    rows = d.shape[0]
    scale = d[..., None] * sc.astype(np.float32)
    return q3_k_codes(hm, qs).reshape(rows, -1), scale.reshape(rows, -1)


def _q3_k(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, None, int]:
    b = _blocks(data, 110)
    sc = q3_k_scales(b[..., 96:108])
    q, scale = q3_k_weight(b[..., 0:32], b[..., 32:96], sc, _f16(b[..., 108:110]))
    return q, scale, None, 16


def q2_k_weight(qs, sc, d, dmin) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [rows, K], scale and offset [rows, K/16]) of Q2_K superblocks given as qs
    [rows, blocks, 64] (value 128h + 32j + l at bits 2j of byte 32h + l, as Q3_K's), the 16
    scale bytes (low nibble the scale of 16 values, high nibble their min) and d, dmin
    float32 [rows, blocks]."""
    rows, nb = d.shape
    qs = qs.reshape(rows, nb, 2, 1, 32)
    q = (qs >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3
    scale = d[..., None] * (sc & 0x0F).astype(np.float32)
    offset = -(dmin[..., None] * (sc >> 4).astype(np.float32))
    return q.astype(np.int8).reshape(rows, -1), scale.reshape(rows, -1), offset.reshape(rows, -1)


def _q2_k(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    b = _blocks(data, 84)  # scales [16], qs [64], d, dmin
    q, scale, offset = q2_k_weight(b[..., 16:80], b[..., 0:16], _f16(b[..., 80:82]),
                                   _f16(b[..., 82:84]))  # fmt: skip
    return q, scale, offset, 16


def q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K superblock's 12 scale bytes [..., 12] as its 8 six-bit scales and 8 six-bit
    mins (uint8 [..., 8] each): sub-blocks 0..3 in the low 6 bits of bytes 0..3 (scales) and
    4..7 (mins); 4..7 split over bytes 8..11 and the top 2 bits."""
    lo_sc, lo_m, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo_sc & 0x3F, (mix & 0x0F) | ((lo_sc >> 2) & 0x30)], axis=-1)
    m = np.concatenate([lo_m & 0x3F, (mix >> 4) | ((lo_m >> 2) & 0x30)], axis=-1)
    return sc, m


def q4_k_weight(qs, sc, m, d, dmin) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [rows, K], scale and offset [rows, K/32]) of Q4_K superblocks given as codes qs
    [rows, blocks, 128], scales and mins [rows, blocks, 8] and d, dmin float32 [rows, blocks]."""
    rows, nb = d.shape
    shifts = np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    q = (qs.reshape(rows, nb, 4, 1, 32) >> shifts) & 0x0F  # 8 groups of 32: chunk, half
    scale = d[..., None] * sc.astype(np.float32)
    offset = -(dmin[..., None] * m.astype(np.float32))
    return q.astype(np.uint8).reshape(rows, -1), scale.reshape(rows, -1), offset.reshape(rows, -1)


def _q4_k(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    b = _blocks(data, 144)
    sc, m = q4_k_scales(b[..., 4:16])
    q, scale, offset = q4_k_weight(b[..., 16:144], sc, m, _f16(b[..., 0:2]), _f16(b[..., 2:4]))
    return q, scale, offset, 32


def q5_k_high_bits(qh: np.ndarray) -> np.ndarray:
    """A Q5_K superblock's 32 qh bytes [..., 32] as each value's fifth bit, uint8 [..., 256]:
    bit j of byte l belongs to value 32j + l."""
    bits = np.unpackbits(qh[..., None], axis=-1, bitorder="little")  # [..., l, j]
    return np.ascontiguousarray(np.swapaxes(bits, -1, -2)).reshape(*qh.shape[:-1], 256)


def _q5_k(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    # d, dmin, the 12 scale bytes as Q4_K's, qh [32], then the low nibbles as Q4_K's qs
    b = _blocks(data, 176)
    sc, m = q4_k_scales(b[..., 4:16])
    q, scale, offset = q4_k_weight(b[..., 48:176], sc, m, _f16(b[..., 0:2]), _f16(b[..., 2:4]))
    q |= q5_k_high_bits(b[..., 16:48]).reshape(q.shape) << 4
    return q.view(np.int8), scale, offset, 32


_DECODERS = {
    "Q8_0": (_q8_0, 8), "Q5_0": (_q5_0, 8), "Q6_K": (_q6_k, 8), "Q4_K": (_q4_k, 4),
    "Q5_K": (_q5_k, 8), "Q4_0": (_q4_0, 8), "Q3_K": (_q3_k, 8), "Q2_K": (_q2_k, 8),
    "Q4_1": (_q4_1, 4), "Q5_1": (_q5_1, 8),
}  # fmt: skip
EXACT_TYPES = tuple(_DECODERS)
# (values, bytes) of one block
BLOCK_SIZES = {
    "Q8_0": (32, 34), "Q5_0": (32, 22), "Q6_K": (QK_K, 210), "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176), "Q4_0": (32, 18), "Q3_K": (QK_K, 110), "Q2_K": (QK_K, 84),
    "Q4_1": (32, 20), "Q5_1": (32, 24),
}  # fmt: skip


def from_gguf_blocks(type_name: str, data: np.ndarray) -> QuantizedWeight:
    """The rows of raw blocks `data` ([N, bytes per row], uint8, as GGUFReader gives a 2-D
    quantized tensor) as a QuantizedWeight. KeyError for types outside EXACT_TYPES."""
    decode, bits = _DECODERS[type_name]
    q, scale, offset, group = decode(np.asarray(data))
    return QuantizedWeight(
        torch.from_numpy(np.ascontiguousarray(q)),
        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)),
        None if offset is None else torch.from_numpy(np.ascontiguousarray(offset)),
        group,
        bits,
    )
