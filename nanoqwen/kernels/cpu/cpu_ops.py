"""ctypes wrappers of cpu_ops.c, a bfloat16 step's small operations on the CPU in one C call
each: add + RMSNorm, SiLU·up, RoPE with the KV write, decode attention (both included), and
the int8 prefill matmul's activation quantization and output scaling.

`cpu_kernels()` is None where the library cannot be built (no C compiler) or NANOQWEN_NATIVE=0;
the model and the attention backend then keep their torch ops.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from nanoqwen.kernels.cpu.build import load_library

SOURCE = Path(__file__).with_name("cpu_ops.c")
_i64, _ptr, _int, _float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


@cache
def cpu_kernels() -> ctypes.CDLL | None:
    lib = load_library(SOURCE, "CPU kernels unavailable, using torch's ops")
    if lib is None:
        return None
    lib.add_rms_norm_bf16.argtypes = [*[_ptr] * 4, _i64, _i64, _float, _int]
    lib.add_rms_norm_bf16.restype = None
    lib.silu_mul_bf16.argtypes = [_ptr, _ptr, _i64, _i64, _int]
    lib.silu_mul_bf16.restype = None
    lib.decode_attention_bf16.argtypes = [
        _ptr, _i64, _i64, *[_ptr] * 4, _i64, *[_ptr] * 4, _i64, _i64, _i64, _i64, _float, _ptr,
        _int,
    ]  # fmt: skip
    lib.decode_attention_bf16.restype = ctypes.c_int
    lib.rope_store_bf16.argtypes = [_ptr, _i64, _i64, *[_ptr] * 6, _i64, _i64, _i64, _ptr, _int]
    lib.rope_store_bf16.restype = None
    lib.quantize_rows_int8.argtypes = [*[_ptr] * 3, _i64, _i64, _int]
    lib.quantize_rows_int8.restype = None
    lib.dequantize_rows_bf16.argtypes = [*[_ptr] * 5, _i64, _i64, _int]
    lib.dequantize_rows_bf16.restype = None
    return lib


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) of bf16 rows, as RMSNorm.forward returns them; the
    sum is written into residual (x itself where residual is None)."""
    x = x.contiguous()
    if residual is not None and not residual.is_contiguous():
        residual = residual.contiguous()
    out = torch.empty_like(x)
    n = x.shape[-1]
    cpu_kernels().add_rms_norm_bf16(
        x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
        out.data_ptr(), x.numel() // n, n, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out, x if residual is None else residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of bf16 rows [..., 2n] = [gate | up]."""
    gate_up = gate_up.contiguous()
    n = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], n)
    cpu_kernels().silu_mul_bf16(
        gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * n), n,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def decode_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    cos_half: torch.Tensor,
    sin_half: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """A decode step's attention (one token a sequence), bf16, with the arguments of the
    Triton kernel's decode_attention (kernels/triton/decode_attention.py): [seqs, heads, dim], the
    rotated k and v written to the caches at slot_mapping."""
    _, block_size, kv_heads, dim = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and qkv.dtype == torch.bfloat16
    seqs = qkv.shape[0]
    heads = qkv.shape[1] // dim - 2 * kv_heads
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    # The C side reads these types as they are: a wrong one would be read as garbage.
    index = [positions.long(), slot_mapping.long(), context_lens.int(), block_tables.int()]
    index = [t.contiguous() for t in index]  # held until the call returns
    tables = index[3]
    out = qkv.new_empty(seqs, heads, dim)
    failed = cpu_kernels().decode_attention_bf16(
        qkv.data_ptr(), qkv.stride(0), seqs, *[t.data_ptr() for t in index], tables.shape[1],
        cos_half.data_ptr(), sin_half.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_size, heads, kv_heads, dim, scale, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("decode attention: out of memory for its scores")
    return out


def rope_and_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_half: torch.Tensor,
    sin_half: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """Every token's rotated q [tokens, heads, dim] (bf16), its rotated k and its v written to
    the caches at slot_mapping: torch's apply_rotary and index_copy_, bit for bit."""
    kv_heads, dim = k_cache.shape[-2:]
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and qkv.dtype == torch.bfloat16
    tokens = qkv.shape[0]
    heads = qkv.shape[1] // dim - 2 * kv_heads
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    index = [positions.long().contiguous(), slot_mapping.long().contiguous()]
    q = qkv.new_empty(tokens, heads, dim)
    cpu_kernels().rope_store_bf16(
        qkv.data_ptr(), qkv.stride(0), tokens, *[t.data_ptr() for t in index],
        cos_half.data_ptr(), sin_half.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        heads, kv_heads, dim, q.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return q


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [M, K], scales float32 [M, 1]) of bf16 rows x, as quant/linear.py's torch
    ops compute them: scale max(max|x|, 1e-30) / 127, codes round(x / scale)."""
    x = x.contiguous()
    rows, k = x.shape
    xq = torch.empty(rows, k, dtype=torch.int8)
    scale = torch.empty(rows, 1, dtype=torch.float32)
    cpu_kernels().quantize_rows_int8(
        x.data_ptr(), xq.data_ptr(), scale.data_ptr(), rows, k, torch.get_num_threads()
    )
    return xq, scale


def dequantize_rows(
    y: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """bf16 (y * x_scale * w_scale) (+ bias) of int32 sums y [M, N], x_scale [M, 1] and
    w_scale [N] float32, bias bf16 [N]: the torch ops' roundings."""
    rows, n = y.shape
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    tensors = [t.contiguous() for t in (y, x_scale, w_scale)]  # held until the call returns
    cpu_kernels().dequantize_rows_bf16(
        *[t.data_ptr() for t in tensors], None if bias is None else bias.contiguous().data_ptr(),
        out.data_ptr(), rows, n, torch.get_num_threads(),
    )  # fmt: skip
    return out
