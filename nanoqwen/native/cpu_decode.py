"""ctypes wrappers of cpu_decode.c: the bfloat16 decode step's add + RMSNorm, SiLU·up and
paged attention (RoPE and the KV write included) on the CPU, one C call each.

`cpu_kernels()` is None where the library cannot be built (no C compiler) or NANOQWEN_NATIVE=0;
the model and the attention backend then keep their torch ops.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from nanoqwen.native.build import load_library

SOURCE = Path(__file__).with_name("cpu_decode.c")
_i64, _ptr, _int, _float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


@cache
def cpu_kernels() -> ctypes.CDLL | None:
    lib = load_library(SOURCE, "CPU decode kernels unavailable, using torch's ops")
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
    return lib


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether these kernels run this setup: bfloat16 on the CPU, the library built."""
    return device.type == "cpu" and dtype == torch.bfloat16 and cpu_kernels() is not None


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
    Triton kernel's decode_attention (kernels/decode_attention.py): [seqs, heads, dim], the
    rotated k and v written to the caches at slot_mapping."""
    _, block_size, kv_heads, dim = k_cache.shape
    seqs = qkv.shape[0]
    heads = qkv.shape[1] // dim - 2 * kv_heads
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
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
