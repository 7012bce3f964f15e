"""SASS of the decode attention kernel's loop over tiles of keys, without a GPU.

Compiles kernels/triton/decode_attention.py for sm_90 at the shapes and settings the engine
launches it with (the decode cases of tests/kernels/triton/sm90_compile.py, which also
specialize its arguments as a launch on 16-byte aligned tensors would) and counts the
instructions of the loop, as tools/quant_gemv_sass.py does for the int4 GEMVs: warp
instructions per KB of keys and values read, and each shared-memory access by its width. A
float8 tile read in the dot's own layout shows up as LDS.U8, one byte a load (a tile's keys
are the inner dimension of the values' dot, and sm_90 has no 8-bit transposing ldmatrix).

Usage: python3 tools/attention_sass.py [--top 8]
"""

from __future__ import annotations

import argparse
import collections
import re

from quant_gemv_sass import loop_opcodes, sm90_compile
from triton.tools import disasm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--top", type=int, default=8, help="opcodes to list")
    top = p.parse_args().top
    for label, kernel, types, flags, warps, stages in sm90_compile.attention_cases():
        if not label.startswith("decode attention"):
            continue
        compiled = sm90_compile.compile_kernel(kernel, types, flags, warps, stages)
        ops = loop_opcodes(disasm.get_sass(compiled.asm["cubin"]), suffixes=True)
        total = sum(ops.values())
        item = 1 if "fp8" in label else 2
        tile_kb = flags["TILE_N"] * flags["HEAD_DIM"] * 2 * item / 1024  # keys and values
        shared = ", ".join(
            f"{op} {n}" for op, n in sorted(ops.items()) if re.match(r"(LDS|STS|LDSM)\b", op)
        )
        common = collections.Counter()
        for op, n in ops.items():
            common[op.split(".")[0]] += n
        listed = ", ".join(f"{op} {n}" for op, n in common.most_common(top))
        print(f"{label}: {total} a thread a tile, {total * warps / tile_kb:.0f} warp "
              f"instructions a KB; shared: {shared}; {listed}")  # fmt: skip


if __name__ == "__main__":
    main()
