"""Which quantized layout each linear weight gets: the `quantization=` choice."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoqwen.quant.format import QuantizedWeight, dequantize, quantize_int4, quantize_int8
from nanoqwen.quant.gguf_forms import is_q8_0

QUANTIZATIONS = ("auto", "none", "int8", "int4")


@dataclass(frozen=True)
class Scheme:
    """bits=8: symmetric int8, one scale per output channel (what torch's CPU int8 kernel
    takes). bits=4: asymmetric int4 in groups of group_size (Q4_K's own layout at 32)."""

    bits: int
    group_size: int | None  # None: per output channel
    # Also keep int4 weights in groups of 32 as they are (a GGUF's Q4_K tensors).
    keep_int4: bool = False
    # Also keep GGUF Q5_0/Q8_0 tensors as they are (the CPU's GGUF kernels read them), and
    # give int8 weights float16 scales (with group_size 32: Q8_0's form).
    keep_gguf_blocks: bool = False

    def fits(self, w: QuantizedWeight) -> bool:
        """Whether w already has this layout (then it is kept as is, without loss)."""
        if self.keep_int4 and w.bits == 4 and w.group_size == 32:
            return True
        if self.keep_gguf_blocks and is_q8_0(w):  # Q5_0 included
            return True
        group = w.shape[1] if self.group_size is None else self.group_size
        return (
            w.bits == self.bits
            and w.group_size == group
            and ((w.offset is None) == (self.bits == 8))
        )

    def apply(self, w: QuantizedWeight | torch.Tensor) -> QuantizedWeight:
        if isinstance(w, QuantizedWeight):
            if self.fits(w):
                return w
            w = dequantize(w)
        if self.bits == 8:
            return quantize_int8(w, self.group_size, float16_scales=self.keep_gguf_blocks)
        return quantize_int4(w, self.group_size or w.shape[1])


SCHEMES = {
    "int8": Scheme(8, None),
    "int4": Scheme(4, 32),
    "gguf": Scheme(8, None, keep_int4=True),
    "gguf-blocks": Scheme(8, 32, keep_int4=True, keep_gguf_blocks=True),
}
# What quantization="auto" gives a GGUF: per-channel int8, Q4_K tensors kept int4; where the
# CPU's GGUF kernels run (bf16/fp16 activations on an AVX2 or AVX-512 CPU) Q5_0, Q4_0, Q8_0 and
# the K-quants kept as they are instead (gguf_packed.from_file; a fused projection whose
# parts differ in layout as gguf_packed.PackedParts, load_gguf._fuse).
# All-int4 (Q5_0/Q6_K/Q8_0 requantized to int4) agreed with the float32 dequantized model's
# argmax at only 93% of the fidelity test's positions (BENCHMARKS.md).
AUTO_GGUF, AUTO_GGUF_BLOCKS = "gguf", "gguf-blocks"


# On a GPU, int4 comes in groups of 128: the tensor-core GEMV (kernels/triton/quant_gemv_mma.py)
# takes groups of whole 128-column panels, and groups of 32 with offsets read 1.5x the bytes
# of the codes alone (BENCHMARKS.md, "int4 batch-1 decode on the tensor cores").
CUDA_SCHEMES = {"int4": Scheme(4, 128)}


def resolve_scheme(
    quantization: str, from_gguf: bool, device_type: str = "cpu", gguf_kernels: bool = False
) -> Scheme | None:
    """None: float weights. auto keeps a GGUF quantized (as AUTO_GGUF, or AUTO_GGUF_BLOCKS
    when `gguf_kernels` says the CPU's GGUF kernels will run) and a float checkpoint float."""
    if quantization == "auto":
        return SCHEMES[AUTO_GGUF_BLOCKS if gguf_kernels else AUTO_GGUF] if from_gguf else None
    if device_type == "cuda" and quantization in CUDA_SCHEMES:
        return CUDA_SCHEMES[quantization]
    return SCHEMES.get(quantization)
