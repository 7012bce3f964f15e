"""Attention backends, chosen by name."""

from __future__ import annotations

import torch

from nanoqwen.attention.metadata import AttentionBackend, AttentionMetadata
from nanoqwen.attention.rotary import RotaryEmbedding
from nanoqwen.attention.torch_backend import TorchAttention
from nanoqwen.validation import choice, invalid

BACKENDS = ("auto", "triton", "flash-attn", "native", "torch")

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "create_backend",
    "flash_attn_problem",
    "native_problem",
    "triton_problem",
]


def triton_problem(
    device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int
) -> str | None:
    """Why the Triton kernels cannot serve this setup, or None when they can."""
    if device.type != "cuda":
        return "it needs a CUDA device"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it needs float16 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "it needs an Ampere or newer GPU"
    if head_dim not in (64, 128):
        return f"head_dim {head_dim} is not supported (64, 128)"
    if block_size < 16:  # the decode kernel copies a tile of 16 keys or more from one block
        return f"block_size {block_size} is below 16"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton does not import ({e})"
    return None


def flash_attn_problem(device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int):
    """Why flash-attn cannot serve this setup, or None when it can."""
    # its prefill needs the RoPE kernel
    problem = triton_problem(device, dtype, head_dim, block_size)
    if problem:
        return problem
    if block_size % 256:
        return f"block_size {block_size} is not a multiple of 256"
    try:
        import flash_attn  # noqa: F401
        from flash_attn.flash_attn_interface import flash_attn_gpu  # noqa: F401  (what flash_backend calls)
    except ImportError as e:
        return f"flash_attn does not import ({e})"
    return None


def native_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the CPU's C kernels (nanoqwen/kernels/cpu/cpu_ops.c) cannot serve this setup, or None
    when they can."""
    if device.type != "cpu":
        return "it runs on the CPU only"
    if dtype != torch.bfloat16:
        return f"it needs bfloat16, not {str(dtype).removeprefix('torch.')}"
    from nanoqwen.kernels.cpu.build import native_enabled
    from nanoqwen.kernels.cpu.cpu_ops import cpu_kernels

    if not native_enabled():
        return "NANOQWEN_NATIVE=0 turns it off"
    if cpu_kernels() is None:
        return "its C library could not be built here: it needs a C compiler"
    return None


def create_backend(
    name: str,
    rotary: RotaryEmbedding,
    scale: float,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    fp8_kv: bool = False,
) -> AttentionBackend:
    """auto: the Triton backend on any CUDA GPU with float16/bfloat16 (with flash-attn's
    kernels inside where flash-attn imports and fits), the native one on a CPU in bfloat16
    where its C library builds, else torch. fp8_kv (a float8 KV cache): the Triton backend
    without flash-attn's kernels, which read the cache in the model's dtype."""
    choice("attention_backend", name, BACKENDS)
    if fp8_kv:
        return _fp8_backend(name, rotary, scale, device, dtype, head_dim, block_size)
    if name == "native" or (name == "auto" and device.type == "cpu"):
        problem = native_problem(device, dtype)
        if problem is None:
            from nanoqwen.attention.native_backend import NativeAttention

            return NativeAttention(rotary, scale)
        if name == "native":
            raise invalid("attention_backend", name, f"is unavailable ({problem})", "auto or torch")
    problem = (
        flash_attn_problem(device, dtype, head_dim, block_size)
        if name == "flash-attn"
        else triton_problem(device, dtype, head_dim, block_size)
    )
    if name in ("flash-attn", "triton") and problem:
        raise invalid("attention_backend", name, f"is unavailable ({problem})", "auto or torch")
    if name == "torch" or problem:
        return TorchAttention(rotary, scale)
    if name == "flash-attn":
        from nanoqwen.attention.flash_backend import FlashAttention

        return FlashAttention(rotary, scale)
    from nanoqwen.attention.triton_backend import TritonAttention

    use_flash = flash_attn_problem(device, dtype, head_dim, block_size) is None
    return TritonAttention(rotary, scale, use_flash_attn=use_flash)


def _fp8_backend(name, rotary, scale, device, dtype, head_dim, block_size) -> AttentionBackend:
    allowed = "auto, or fp8 with the Triton attention on a CUDA GPU in float16/bfloat16"
    if name not in ("auto", "triton"):
        raise invalid(
            "kv_cache_dtype", "fp8", f"does not work with attention_backend={name!r}", allowed
        )
    problem = triton_problem(device, dtype, head_dim, block_size)
    if problem:
        raise invalid(
            "kv_cache_dtype", "fp8", f"needs the Triton attention, unavailable here ({problem})",
            allowed,
        )  # fmt: skip
    from nanoqwen.attention.triton_backend import TritonAttention

    return TritonAttention(rotary, scale, use_flash_attn=False)
