"""Which device and activation dtype an engine runs on, from the user's choices and the
machine (and whether that makes no --model the default model's GGUF)."""

from __future__ import annotations

import torch

from nanoqwen.kernels.cpu.gguf import gguf_kernel
from nanoqwen.validation import choice, invalid

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_name(device: str) -> str:
    """auto: cuda when this machine has it, else cpu; any other name as it is."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_device(device: str) -> torch.device:
    allowed = "auto, cpu, cuda, cuda:N"
    device = device_name(device)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise invalid("device", device, "is unknown", allowed) from None
    if dev.type not in ("cpu", "cuda"):
        raise invalid("device", device, "is not supported", allowed)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise invalid("device", device, "but CUDA is not available on this machine", "cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise invalid(
            "device", device, "does not exist", f"cuda:0..cuda:{torch.cuda.device_count() - 1}"
        )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def cpu_has_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic natively (AVX512-BF16 or AMX), as torch sees it."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_dtype(
    dtype: str, device: torch.device, stored: torch.dtype, gguf_kernels: bool = False
) -> torch.dtype:
    """auto: the checkpoint's dtype on CUDA; on the CPU bfloat16 where the CPU has bf16
    instructions, or where the matmuls run in the GGUF kernels (gguf_kernels: a GGUF kept
    quantized and those kernels built here, which take bf16 activations on AVX2 too), except
    for float32 checkpoints, which stay float32 as on CUDA."""
    if dtype == "auto":
        if device.type == "cuda":
            return stored
        bf16 = cpu_has_bf16() or gguf_kernels
        return torch.bfloat16 if stored != torch.float32 and bf16 else torch.float32
    return DTYPES[choice("dtype", dtype, ["auto", *DTYPES])]


def default_is_quantized(dev: torch.device, dtype: str, quantization: str, tp: int) -> bool:
    """Whether no --model means the default model's GGUF, quantized: on the CPU with
    quantization="auto" and bf16/fp16 activations (float32, the token-exact mode, and the
    GPU run the float checkpoint, as do tensor-parallel runs, which take no quantized
    weights)."""
    if dev.type != "cpu" or quantization != "auto" or tp != 1:
        return False
    kernels = gguf_kernel() is not None
    return resolve_dtype(dtype, dev, torch.bfloat16, gguf_kernels=kernels) != torch.float32
