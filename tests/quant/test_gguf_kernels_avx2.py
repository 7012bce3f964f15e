"""The GGUF kernels built for AVX2 (simd16.h's two halves a vector) give the AVX-512 build's
outputs bit for bit: every format, decode and verify rows, float32 and bfloat16 with a bias,
and the per-channel copies for prefill. Runs where the CPU has AVX512-VNNI, building the AVX2
kernels beside the native ones with NANOQWEN_CFLAGS=-mno-avx512f in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_gguf import random_blocks

from nanoqwen.kernels.cpu.gguf import (
    fifth_bit_planes,
    gguf_kernel,
    gguf_matmul,
    max_rows,
    requantize_packed,
)
from nanoqwen.kernels.cpu.gguf_lanes import LANE_KINDS, to_lanes
from nanoqwen.quant.gguf_packed import from_file

pytest.importorskip("gguf")
TYPES = ["Q5_0", "Q8_0", "Q4_0", "Q5_1", "Q4_1", "Q6_K", "Q3_K", "Q2_K", "Q4_K", "Q5_K"]


def outputs() -> dict[str, torch.Tensor]:
    """Each format's products (40 outputs: 16, 16 and a partial 8; K: 896, a group of 16
    blocks and one of 12, or the K-quants' 4864) at 1, 5 and the most rows a call takes, and
    its per-channel int8 copy, from random bytes (every code and high-bit pattern)."""
    found = {}
    for type_name in TYPES:
        k = 4864 if type_name.endswith("_K") else 896
        packed = from_file(type_name, random_blocks(type_name, 40, k, seed=len(found)))
        kind = packed.kind
        planes = fifth_bit_planes()  # each build packs the fifth bits as it reads them
        lanes = kind in LANE_KINDS
        tensors = to_lanes(kind, packed.tensors, planes=planes) if lanes else packed.tensors
        codes, scales = requantize_packed(kind, packed.tensors)
        found[f"{type_name} copy"], found[f"{type_name} scales"] = codes, scales
        bias = torch.randn(40, generator=torch.Generator().manual_seed(1)).bfloat16()
        for rows in (1, 5, max_rows(kind)):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
            found[f"{type_name} {rows} float32"] = gguf_matmul(x.float(), kind, tensors)
            found[f"{type_name} {rows} bf16"] = gguf_matmul(x, kind, tensors, bias)
    return found


@pytest.mark.skipif(
    gguf_kernel() is None or not torch.cpu._is_vnni_supported(),
    reason="needs AVX512-VNNI: on this CPU the native build is the AVX2 one",
)
def test_avx2_build_equals_avx512_build(tmp_path):
    saved = tmp_path / "avx2.pt"
    here = Path(__file__).parent  # and tests/, whose conftest tiny_gguf imports
    script = (
        f"import sys, torch\nsys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]\n"
        "from test_gguf_kernels_avx2 import outputs\n"
        f"torch.save(outputs(), {str(saved)!r})\n"
    )
    env = {**os.environ, "NANOQWEN_CFLAGS": "-mno-avx512f"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    avx2, native = torch.load(saved), outputs()
    assert avx2.keys() == native.keys()
    differ = [name for name in native if not torch.equal(avx2[name], native[name])]
    assert not differ, f"the AVX2 build differs in {differ}"
