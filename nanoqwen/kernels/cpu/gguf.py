"""The C kernels of gguf_gemv.c and gguf_kquants.c: GGUF Q5_0, Q4_0, Q5_1, Q4_1, Q8_0, Q6_K,
Q3_K, Q2_K, Q4_K and Q5_K weights kept as they are in the file for the few-row CPU matmuls of
decode (Q5_0: 5.5 bits a weight, against 8 for torch's per-channel int8 kernel; Q4_0: 4.5,
where Q5_0's form of it read 5.5; Q5_1 and Q4_1: 6 and 5, where they were requantized; Q8_0:
8.5 bits, exact where per-channel int8 requantizes, and faster; Q6_K: 6.56 bits, where Q8_0's
form of it took 8.5 and rounded it again; Q3_K: 3.56 with its scales unpacked, where Q6_K's
form took 6.56; Q2_K: 2.63, where Q8_0's form took 8.5; Q4_K: 4.63, where torch's int4 kernel
read 5; Q5_K: 5.63, where it was requantized to Q8_0's form, 8.5).

They are compiled at first use (nanoqwen/kernels/cpu/build.py) and called through ctypes, for
AVX512-VNNI or, without it, AVX2 (simd16.h; the same outputs bit for bit); where there is no
compiler or the CPU lacks AVX2, FMA or F16C the build fails once and `gguf_kernel()`
(`kquant_kernel()`) returns None, and the layers keep torch's kernels.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from nanoqwen.kernels.cpu.build import load_library
from nanoqwen.kernels.cpu.gguf_lanes import LANE_KINDS

SOURCE = Path(__file__).with_name("gguf_gemv.c")
KQUANT_SOURCE = Path(__file__).with_name("gguf_kquants.c")
MAX_ROWS = 8  # MAX_ROWS in gguf_common.h: Q3_K's and Q2_K's kernel
LANE_MAX_ROWS = 16  # LANE_MAX_ROWS in gguf_gemv.c: gguf_lanes.LANE_KINDS
_c_int64, _ptr = ctypes.c_int64, ctypes.c_void_p


_int = ctypes.c_int
_REQUANTIZE = [_c_int64, _c_int64, _ptr, _ptr, _int]  # N, K, out, r, threads


def _gemv(weight_arrays: int) -> tuple[list, type]:
    """A few-row matmul's signature: x, is_bf16, M, K, the weight's arrays, N, y, out_bf16,
    bias, threads."""
    return [_ptr, _int, _c_int64, _c_int64, *[_ptr] * weight_arrays, _c_int64, _ptr, _int, _ptr,
            _int], ctypes.c_int  # fmt: skip


def _library(source: Path, note: str, signatures: dict) -> ctypes.CDLL | None:
    """source's library with the functions' ctypes signatures set, or None (with one note on
    stderr) when it cannot be built here. NANOQWEN_NATIVE=0 turns it off."""
    lib = load_library(source, note)
    if lib is None:
        return None
    for name, (argtypes, restype) in signatures.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = restype
    return lib


@cache
def gguf_kernel() -> ctypes.CDLL | None:
    """gguf_gemv.c's library (Q5_0, Q4_0, Q5_1, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K in lanes, and
    the int8 prefill copies of the first five)."""
    return _library(SOURCE, "GGUF CPU kernels unavailable, using torch's int8 kernel", {
        "q5_gemv": _gemv(3),  # qs, hm, d (in lanes)
        "q8_gemv": _gemv(2),  # qs, d
        "q4_gemv": _gemv(2),  # qs, d
        "q51_gemv": _gemv(4),  # qs, hm, d, m
        "q41_gemv": _gemv(3),  # qs, d, m
        "q4k_lanes_gemv": _gemv(5),  # qs, sc, m, d, dmin
        "q5k_lanes_gemv": _gemv(6),  # qs, hm, sc, m, d, dmin
        "q6k_lanes_gemv": _gemv(3),  # qs, sc, d
        "requantize_rows": ([_ptr, _ptr, *[_c_int64] * 3, _ptr, _ptr, _int], None),
        "requantize_q5_rows": ([*[_ptr] * 3, *_REQUANTIZE], None),
        "requantize_q8_rows": ([*[_ptr] * 2, *_REQUANTIZE], None),
        "requantize_q4_rows": ([*[_ptr] * 2, *_REQUANTIZE], None),
        "requantize_q51_rows": ([*[_ptr] * 4, *_REQUANTIZE], None),
        "requantize_q41_rows": ([*[_ptr] * 3, *_REQUANTIZE], None),
        "gguf_fifth_bit_planes": ([], _int),
    })  # fmt: skip


def fifth_bit_planes() -> bool:
    """Whether the built kernels read the five-bit formats' fifth bits as bit planes (AVX2)
    rather than masks (AVX-512): gguf_lanes.to_lanes' `planes`."""
    library = gguf_kernel()
    return library is not None and bool(library.gguf_fifth_bit_planes())


@cache
def kquant_kernel() -> ctypes.CDLL | None:
    """gguf_kquants.c's library (Q3_K and Q2_K; the per-channel copies of those and of Q6_K,
    Q4_K and Q5_K, whose few-row kernel is gguf_gemv.c's)."""
    return _library(KQUANT_SOURCE, "GGUF K-quant CPU kernels unavailable", {
        "q3k_gemv": _gemv(4),  # qs, hm, sc, d
        "q2k_gemv": _gemv(4),  # qs, sc, d, dmin
        "requantize_q6k_rows": ([*[_ptr] * 4, *_REQUANTIZE], None),
        "requantize_q3k_rows": ([*[_ptr] * 4, *_REQUANTIZE], None),
        "requantize_q2k_rows": ([*[_ptr] * 4, *_REQUANTIZE], None),
        "requantize_q4k_rows": ([*[_ptr] * 5, *_REQUANTIZE], None),
        "requantize_q5k_rows": ([*[_ptr] * 6, *_REQUANTIZE], None),
    })  # fmt: skip


# By kind: (library, few-row matmul, library, per-channel int8 copy); SUPERBLOCK_KINDS' blocks
# hold 256 values, the others 32.
_KERNELS = {
    "q5_0": (gguf_kernel, "q5_gemv", gguf_kernel, "requantize_q5_rows"),
    "q8_0": (gguf_kernel, "q8_gemv", gguf_kernel, "requantize_q8_rows"),
    "q4_0": (gguf_kernel, "q4_gemv", gguf_kernel, "requantize_q4_rows"),
    "q5_1": (gguf_kernel, "q51_gemv", gguf_kernel, "requantize_q51_rows"),
    "q4_1": (gguf_kernel, "q41_gemv", gguf_kernel, "requantize_q41_rows"),
    "q6_k": (gguf_kernel, "q6k_lanes_gemv", kquant_kernel, "requantize_q6k_rows"),
    "q3_k": (kquant_kernel, "q3k_gemv", kquant_kernel, "requantize_q3k_rows"),
    "q2_k": (kquant_kernel, "q2k_gemv", kquant_kernel, "requantize_q2k_rows"),
    "q4_k": (gguf_kernel, "q4k_lanes_gemv", kquant_kernel, "requantize_q4k_rows"),
    "q5_k": (gguf_kernel, "q5k_lanes_gemv", kquant_kernel, "requantize_q5k_rows"),
}
SUPERBLOCK_KINDS = ("q6_k", "q3_k", "q2_k", "q4_k", "q5_k")


def max_rows(kind: str) -> int:
    """The most rows one gguf_matmul call of `kind` takes."""
    return LANE_MAX_ROWS if kind in LANE_KINDS else MAX_ROWS


def gguf_matmul(
    x: torch.Tensor, kind: str, packed: tuple[torch.Tensor, ...], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M <= max_rows(kind), K] (contiguous) @ W.T, W of `kind` as gguf_packed keeps it
    (pack_q5_0's, pack_q8_0's), Q5_0, Q4_0, Q5_1, Q4_1 and Q8_0 then put in lanes by
    gguf_lanes.to_lanes: float32 [M, N], or
    for bfloat16 x bfloat16 with bias (bfloat16) added, rounded as F.linear's output and then
    its bias add would be, in the one kernel."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()  # float16: the kernels read bf16 or float32
    out_bf16 = x.dtype == torch.bfloat16
    assert bias is None or (out_bf16 and bias.dtype == torch.bfloat16 and bias.is_contiguous())
    rows, k = x.shape
    n = packed[0].shape[0]
    out = torch.empty(rows, n, dtype=x.dtype)
    if rows == 0:  # a prefill chunk that ends no prompt asks the lm_head for no rows
        return out
    library, gemv, _, _ = _KERNELS[kind]
    status = getattr(library(), gemv)(
        x.data_ptr(), int(out_bf16), rows, k, *[t.data_ptr() for t in packed], n,
        out.data_ptr(), int(out_bf16), None if bias is None else bias.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise RuntimeError(f"gguf_gemv failed (status {status}) for x {tuple(x.shape)}")
    return out


def requantize_rows(
    q: torch.Tensor, scale: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes q [N, K] with a scale per group as per-channel int8: (codes int8
    [N, K], row scales float32 [N, 1]), in C (one pass over the codes, where torch takes
    several over float32 copies: seconds at load for the 0.5B model)."""
    n, k = q.shape
    q, s = q.contiguous(), scale.contiguous()
    out, row = torch.empty(n, k, dtype=torch.int8), torch.empty(n, 1, dtype=torch.float32)
    gguf_kernel().requantize_rows(
        q.data_ptr(), s.data_ptr(), n, k, group_size, out.data_ptr(), row.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out, row


def requantize_packed(
    kind: str, packed: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel int8 codes and row scales of the weight that packed blocks of `kind`
    hold, read from the blocks themselves: Q8_0, Q5_0 and Q4_0 as requantize_rows, Q5_1 and
    Q4_1 as gguf_gemv.c says, the K-quants as gguf_kquants.c."""
    n, blocks = packed[-1].shape
    k = blocks * (256 if kind in SUPERBLOCK_KINDS else 32)
    out, row = torch.empty(n, k, dtype=torch.int8), torch.empty(n, 1, dtype=torch.float32)
    _, _, library, requantize = _KERNELS[kind]
    tensors = [t.contiguous() for t in packed]  # held until the call returns
    getattr(library(), requantize)(
        *[t.data_ptr() for t in tensors], n, k, out.data_ptr(), row.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out, row
