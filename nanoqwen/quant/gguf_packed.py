"""GGUF Q5_0, Q4_0, Q5_1, Q4_1, Q8_0 and K-quant tensors read straight from the file into the
CPU kernels' layouts.

Where the scheme keeps these blocks for the C kernels (Scheme.keep_gguf_blocks: bf16/fp16
activations on an AVX2 or AVX-512 CPU), the canonical QuantizedWeight was only a stop on the way:
every 5-bit code unpacked to int8, then packed back by gguf_forms.pack_q5_0 (with Q8_0's round
trip, over a second of the default model's CPU start on two cores). A Q5_0 block is d (2
bytes), qh (4) and qs (16), which are pack_q5_0's three arrays already, so each is one strided
copy out of the memory-mapped file (the kernels read them apart, not interleaved); a Q8_0
block's codes get pack_q8_0's +128 in one pass. The result equals gguf_forms.pack_q5_0 /
pack_q8_0 of the canonical weight bit for bit (tests/quant/test_gguf_packed.py), and the
choice between the two follows QuantizedLinear.prepare's: Q5_0 exactly when every code is
in -16..15. Q4_0, Q5_1, Q4_1 and the K-quants, for which the canonical route has no packing
of their own, keep the file's arrays (a K-quant's packed scales unpacked).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanoqwen.kernels.cpu.gguf import SUPERBLOCK_KINDS, gguf_kernel, kquant_kernel
from nanoqwen.quant.format import QuantizedWeight
from nanoqwen.quant.gguf_blocks import (
    BLOCK_SIZES,
    from_gguf_blocks,
    q2_k_weight,
    q3_k_scales,
    q3_k_weight,
    q4_k_scales,
    q4_k_weight,
    q5_k_high_bits,
)
from nanoqwen.quant.scheme import Scheme

BLOCK_BYTES = {
    name: BLOCK_SIZES[name][1]
    for name in ("Q5_0", "Q8_0", "Q6_K", "Q4_K", "Q5_K", "Q4_0", "Q3_K", "Q2_K", "Q4_1", "Q5_1")
}
_Q5_IN_Q8 = 112  # a Q5_0 value v (0..31, code v - 16) as pack_q8_0's byte: v - 16 + 128


@dataclass(frozen=True)
class PackedBlocks:
    """A weight as kernels.cpu.gguf.gguf_matmul takes it: Q5_0 (qs uint8 [N, K/32, 16], qh int32
    [N, K/32], d float16 [N, K/32]), Q4_0 (Q5_0's qs and d, no qh), Q5_1 and Q4_1 (Q5_0's and
    Q4_0's with a float16 min m [N, K/32] last), Q8_0 (qs uint8 [N, K/32,
    32] = code + 128, d), Q6_K (the file's superblocks in four arrays: ql uint8 [N, K/256,
    128], qh uint8 [N, K/256, 64], sc int8 [N, K/256, 16], d float16 [N, K/256]), Q3_K
    (four: the file's qs uint8 [N, K/256, 64] and hmask uint8 [N, K/256, 32], its scales
    unpacked minus 32, int8 [N, K/256, 16], and d), Q2_K (four, the file's: qs uint8 [N,
    K/256, 64] as Q3_K's, scales and mins uint8 [N, K/256, 16], d and dmin float16 [N,
    K/256]), Q4_K (five: qs uint8 [N, K/256, 128], its scales and mins unpacked, uint8 [N,
    K/256, 8] each, d and dmin) or Q5_K (six: Q4_K's with the fifth bits second, int32 [N,
    K/256, 8], word j bit l for value 32j + l); gguf_gemv.c and gguf_kquants.c say how they
    are read. kind: "q5_0", "q4_0", "q5_1", "q4_1", "q8_0", "q6_k", "q3_k", "q2_k", "q4_k" or
    "q5_k"."""

    kind: str
    tensors: tuple[torch.Tensor, ...]

    # The canonical weight's, which QuantizedLinear reports (describe(), extra_repr).
    @property
    def bits(self) -> int:
        return 4 if self.kind in ("q4_k", "q4_1") else 8  # Q5_K's, Q5_1's codes 0..31: int8's

    @property
    def group_size(self) -> int:
        return 16 if self.kind in ("q6_k", "q3_k", "q2_k") else 32

    @property
    def shape(self) -> tuple[int, int]:
        n, blocks = self.tensors[-1].shape
        return n, blocks * (256 if self.kind in SUPERBLOCK_KINDS else 32)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def to(self, device: torch.device | str) -> PackedBlocks:
        return PackedBlocks(self.kind, tuple(t.to(device) for t in self.tensors))


def keeps_file_blocks(scheme: Scheme | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether QuantizedLinear.prepare would put a load's Q5_0/Q8_0 weights into the C
    kernels' layout (the scheme keeps them, the kernels run): then they can go there directly."""
    return (
        scheme is not None
        and scheme.keep_gguf_blocks
        and device.type == "cpu"
        and dtype != torch.float32
        and gguf_kernel() is not None
    )


def from_file(type_name: str, data: np.ndarray) -> PackedBlocks | None:
    """The raw rows of blocks `data` ([N, bytes per row], as GGUFReader gives them) in the
    kernels' layout; None for other types and where prepare picks another kernel for the
    canonical weight (one block per row is per-channel int8; a NaN scale fails is_q8_0)."""
    if type_name not in BLOCK_BYTES:
        return None
    b = np.asarray(data).reshape(data.shape[0], -1, BLOCK_BYTES[type_name])
    if type_name in _SUPERBLOCK_READERS:
        return _SUPERBLOCK_READERS[type_name](b) if kquant_kernel() is not None else None
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
    if type_name in ("Q4_1", "Q5_1"):
        m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0]
        if np.isnan(d).any() or np.isnan(m).any():
            return None
        if type_name == "Q4_1":
            return _packed("q4_1", np.ascontiguousarray(b[..., 4:20]), d, m)
        qh = np.ascontiguousarray(b[..., 4:8]).view(np.int32)[..., 0]
        return _packed("q5_1", np.ascontiguousarray(b[..., 8:24]), qh, d, m)
    if b.shape[1] == 1 or np.isnan(d).any():
        return None
    if type_name == "Q5_0":
        qh = np.ascontiguousarray(b[..., 2:6]).view(np.int32)[..., 0]
        return _packed("q5_0", np.ascontiguousarray(b[..., 6:22]), qh, d)
    if type_name == "Q4_0":
        return _packed("q4_0", np.ascontiguousarray(b[..., 2:18]), d)
    qs = b[..., 2:34] ^ np.uint8(0x80)  # int8 code -> code + 128, a new contiguous array
    return _q5_0_from_q8(qs, d) if _fits_q5_0(qs) else _packed("q8_0", qs, d)


def _q6_k(b: np.ndarray) -> PackedBlocks | None:
    """Q6_K superblocks [N, K/256, 210] split into the kernel's four arrays (one strided copy
    each); None for a NaN scale (the canonical route handles it)."""
    d = np.ascontiguousarray(b[..., 208:210]).view(np.float16)[..., 0]
    if np.isnan(d).any():
        return None
    ql, qh = np.ascontiguousarray(b[..., 0:128]), np.ascontiguousarray(b[..., 128:192])
    return _packed("q6_k", ql, qh, np.ascontiguousarray(b[..., 192:208]).view(np.int8), d)


def _q3_k(b: np.ndarray) -> PackedBlocks | None:
    """Q3_K superblocks [N, K/256, 110] as the kernel's four arrays: the file's qs and hmask,
    its scales unpacked (3.44 bits a weight in the file, 3.56 here); None for a NaN d."""
    d = np.ascontiguousarray(b[..., 108:110]).view(np.float16)[..., 0]
    if np.isnan(d).any():
        return None
    hm, qs = np.ascontiguousarray(b[..., 0:32]), np.ascontiguousarray(b[..., 32:96])
    return _packed("q3_k", qs, hm, q3_k_scales(b[..., 96:108]), d)


def _q2_k(b: np.ndarray) -> PackedBlocks | None:
    """Q2_K superblocks [N, K/256, 84] (scales [16], qs [64], d, dmin) as the kernel's four
    arrays, the file's own (2.63 bits a weight); None for a NaN d or dmin."""
    d = np.ascontiguousarray(b[..., 80:82]).view(np.float16)[..., 0]
    dmin = np.ascontiguousarray(b[..., 82:84]).view(np.float16)[..., 0]
    if np.isnan(d).any() or np.isnan(dmin).any():
        return None
    qs, sc = np.ascontiguousarray(b[..., 16:80]), np.ascontiguousarray(b[..., 0:16])
    return _packed("q2_k", qs, sc, d, dmin)


def _q4_k(b: np.ndarray, qs_at: int = 16) -> PackedBlocks | None:
    """Q4_K superblocks [N, K/256, 144] as the kernel's five arrays, the scales unpacked;
    None for a NaN d or dmin. qs_at: where the 128 code bytes start (Q5_K's: 48)."""
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
    dmin = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0]
    if np.isnan(d).any() or np.isnan(dmin).any():
        return None
    sc, m = q4_k_scales(b[..., 4:16])
    qs = np.ascontiguousarray(b[..., qs_at : qs_at + 128])
    return _packed("q4_k", qs, np.ascontiguousarray(sc), np.ascontiguousarray(m), d, dmin)


def _q5_k(b: np.ndarray) -> PackedBlocks | None:
    """Q5_K superblocks [N, K/256, 176] as Q4_K's five arrays with the fifth bits second, as
    a mask a 32 values (the kernel adds 16 to the codes a mask selects)."""
    four = _q4_k(b, qs_at=48)  # d, dmin and the scales where Q4_K has them, qh before qs
    if four is None:
        return None
    high = np.packbits(q5_k_high_bits(b[..., 16:48]).reshape(*b.shape[:2], 8, 32), axis=-1,
                       bitorder="little")  # fmt: skip
    qs, *rest = four.tensors
    return PackedBlocks("q5_k", (qs, torch.from_numpy(high.view(np.int32)[..., 0]), *rest))


_SUPERBLOCK_READERS = {
    "Q6_K": _q6_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q3_K": _q3_k, "Q2_K": _q2_k,
}  # fmt: skip


def can_cat(parts: list[PackedBlocks]) -> bool:
    """Whether cat_packed takes these parts: Q5_0, Q4_0 and Q8_0 ones, or ones of one other
    kind (a superblock layout, or blocks with a min, stacks with nothing else)."""
    kinds = {p.kind for p in parts}
    return len(kinds) == 1 or not kinds - {"q5_0", "q4_0", "q8_0"}


@dataclass(frozen=True)
class PackedParts:
    """A fused projection whose parts do not all stack (a K-quant part beside parts of
    other layouts, as llama.cpp's Q4_K_M files give attn_v Q6_K in some layers): each run of
    parts that stacks keeps its own blocks and kernel, and the projection's output rows are
    theirs in order. Their canonical weights differ in layout, so QuantizedLinear reports
    the parts' kinds."""

    parts: tuple[PackedBlocks, ...]

    @property
    def kind(self) -> str:
        return "+".join(p.kind for p in self.parts)

    @property
    def bits(self) -> int:
        return max(p.bits for p in self.parts)

    @property
    def group_size(self) -> int:
        return min(p.group_size for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def to(self, device: torch.device | str) -> PackedParts:
        return PackedParts(tuple(p.to(device) for p in self.parts))


def stack_packed(parts: list[PackedBlocks]) -> PackedBlocks | PackedParts:
    """A fused projection's parts, in order, stacked as far as they stack (cat_packed)."""
    runs = [[parts[0]]]
    for p in parts[1:]:
        if can_cat([*runs[-1], p]):
            runs[-1].append(p)
        else:
            runs.append([p])
    stacked = tuple(cat_packed(run) for run in runs)
    return stacked[0] if len(stacked) == 1 else PackedParts(stacked)


def cat_packed(parts: list[PackedBlocks]) -> PackedBlocks:
    """The packing of format.cat_rows of the parts' canonical weights (a fused projection):
    their own when all share one, Q8_0 beside a Q8_0 part (codes beyond -16..15), else Q5_0
    (Q4_0 parts beside Q5_0 ones)."""
    if len(parts) == 1:
        return parts[0]
    kinds = {p.kind for p in parts}
    if "q8_0" in kinds:
        parts = [as_q8_0(p) for p in parts]
    elif len(kinds) > 1:
        parts = [as_q5_0(p) for p in parts]
    columns = zip(*(p.tensors for p in parts))
    return PackedBlocks(parts[0].kind, tuple(torch.cat(column) for column in columns))


def as_q5_0(p: PackedBlocks) -> PackedBlocks:
    """A Q5_0 or Q4_0 p in Q5_0's layout (pack_q5_0 of the same canonical weight)."""
    if p.kind == "q5_0":
        return p
    # Q4_0's code c - 8 is Q5_0's (c + 8) - 16: nibble c ^ 8, fifth bit c >= 8.
    qs, d = (t.numpy() for t in p.tensors)
    high = np.concatenate([(qs >> 3) & 1, qs >> 7], axis=-1)
    qh = np.packbits(high, axis=-1, bitorder="little").view(np.int32)[..., 0]
    return _packed("q5_0", qs ^ np.uint8(0x88), qh, d)


def as_q8_0(p: PackedBlocks) -> PackedBlocks:
    """p in Q8_0's layout (pack_q8_0 of the same canonical weight)."""
    if p.kind == "q8_0":
        return p
    qs, qh, d = (t.numpy() for t in as_q5_0(p).tensors)
    high = np.unpackbits(qh.view(np.uint8).reshape(*qh.shape, 4), axis=-1, bitorder="little")
    values = np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | (high << 4)  # 0..31
    return _packed("q8_0", values + np.uint8(_Q5_IN_Q8), d)


def to_canonical(p: PackedBlocks) -> QuantizedWeight:
    """The canonical weight p packs (what gguf_blocks.from_gguf_blocks reads from the file):
    for fusing with a part of another layout, which takes the canonical route."""
    if p.kind in ("q4_k", "q5_k"):
        qs, *high, sc, m, d, dmin = (t.numpy() for t in p.tensors)
        q, scale, offset = q4_k_weight(qs, sc, m, d.astype(np.float32), dmin.astype(np.float32))
        if high:  # word j's bit l: value 32j + l's fifth bit
            bits = np.unpackbits(high[0].view(np.uint8), axis=-1, bitorder="little")
            q = (q | bits.reshape(q.shape) << 4).view(np.int8)
        tensors = (torch.from_numpy(a) for a in (q, scale, offset))
        return QuantizedWeight(*tensors, 32, 8 if high else 4)
    if p.kind in ("q4_1", "q5_1"):
        qs, *qh, d, m = (t.numpy() for t in p.tensors)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        if qh:  # bit j: value j's fifth bit
            high = np.unpackbits(qh[0].view(np.uint8).reshape(*qh[0].shape, 4), axis=-1,
                                 bitorder="little")  # fmt: skip
            q = (q | high << 4).view(np.int8)
        codes = torch.from_numpy(q.reshape(q.shape[0], -1))
        scale, offset = (torch.from_numpy(a.astype(np.float32)) for a in (d, m))
        return QuantizedWeight(codes, scale, offset, 32, 8 if qh else 4)
    if p.kind == "q2_k":
        qs, sc, d, dmin = (t.numpy() for t in p.tensors)
        q, scale, offset = q2_k_weight(qs, sc, d.astype(np.float32), dmin.astype(np.float32))
        tensors = (torch.from_numpy(a) for a in (q, scale, offset))
        return QuantizedWeight(*tensors, 16, 8)
    if p.kind == "q3_k":
        qs, hm, sc, d = (t.numpy() for t in p.tensors)
        q, scale = q3_k_weight(hm, qs, sc, d.astype(np.float32))
        return QuantizedWeight(torch.from_numpy(q), torch.from_numpy(scale), None, 16, 8)
    if p.kind == "q6_k":
        ql, qh, sc, d = (t.numpy() for t in p.tensors)
        raw = [ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(*d.shape, 2)]
        return from_gguf_blocks("Q6_K", np.concatenate(raw, axis=-1).reshape(len(ql), -1))
    qs, d = (t.numpy() for t in as_q8_0(p).tensors)
    n, k = p.shape
    codes = (qs ^ np.uint8(0x80)).view(np.int8).reshape(n, k)
    return QuantizedWeight(
        torch.from_numpy(codes), torch.from_numpy(d.astype(np.float32)), None, 32, 8
    )


def _fits_q5_0(qs: np.ndarray) -> bool:
    """Whether every code of Q8_0 bytes qs is in -16..15 (gguf_forms.is_q5_0). A real Q8_0 block
    has a code of +-127 (its scale is max|w| / 127), so the first row nearly always answers."""
    return all(int(part.min()) >= 128 - 16 and int(part.max()) <= 128 + 15 for part in (qs[:1], qs))


def _q5_0_from_q8(qs: np.ndarray, d: np.ndarray) -> PackedBlocks:
    """Q8_0 bytes whose codes all fit in five bits, packed as pack_q5_0 packs them."""
    values = qs - np.uint8(_Q5_IN_Q8)
    low = values & 0x0F
    packed = low[..., :16] | (low[..., 16:] << 4)
    qh = np.packbits(values >> 4, axis=-1, bitorder="little").view(np.int32)[..., 0]
    return _packed("q5_0", np.ascontiguousarray(packed), np.ascontiguousarray(qh), d)


def _packed(kind: str, *arrays: np.ndarray) -> PackedBlocks:
    return PackedBlocks(kind, tuple(torch.from_numpy(a) for a in arrays))
