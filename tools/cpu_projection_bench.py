"""A Q4_K_M or Q5_K_M file's fused projections on the CPU, one decode row: as the file's
blocks (each part's C kernel, PackedParts where layouts differ) against what the loader made
of them before (Q4_K + Q4_K: torch's int4 kernel; Q5_K, which it did not read: Q8_0's form;
a Q6_K part beside others: per-channel int8 for all).

    python3 tools/cpu_projection_bench.py --shape 1.5B --main Q4_K --reps 200

Random superblocks of the real shapes (llama.cpp's Q4_K_M / Q5_K_M: q, k, gate, up Q4_K /
Q5_K; v Q6_K in about half the layers, like the rest in the others). Prints µs a call,
median of --reps, per layout.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from nanoqwen.model.load_gguf import _fuse
from nanoqwen.quant.format import cat_rows, dequantize
from nanoqwen.quant.gguf_blocks import BLOCK_SIZES, from_gguf_blocks
from nanoqwen.quant.gguf_packed import from_file
from nanoqwen.quant.linear import QuantizedLinear
from nanoqwen.quant.scheme import SCHEMES

F16_AT = {"Q6_K": (208,), "Q4_K": (0, 2), "Q5_K": (0, 2)}  # d (and dmin) in a superblock

SHAPES = {  # hidden, intermediate, heads, kv heads (head_dim 128)
    "1.5B": (1536, 8960, 12, 2),
    "3B": (2048, 11008, 16, 2),
    "7B": (3584, 18944, 28, 4),
}


def random_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Rows of superblocks with random codes and small finite float16 scales."""
    values, size = BLOCK_SIZES[type_name]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    for at in F16_AT[type_name]:
        d = (rng.standard_normal((n, k // values)) * 1e-3).astype(np.float16)
        b[..., at : at + 2] = d.view(np.uint8).reshape(n, k // values, 2)
    return b.reshape(n, -1)


def before(blocks: list[tuple[str, np.ndarray]]):
    """What the loader made of these parts before they kept their blocks."""
    weights = [
        SCHEMES["gguf-blocks"].apply(dequantize(from_gguf_blocks(t, raw)))  # not read: float
        if t == "Q5_K"
        else from_gguf_blocks(t, raw)
        for t, raw in blocks
    ]
    try:
        return cat_rows(weights)
    except ValueError:
        return cat_rows([SCHEMES["int8"].apply(w) for w in weights])


def time_layer(weight, k: int, reps: int) -> tuple[str, float]:
    layer = QuantizedLinear(weight, None)
    layer.prepare(torch.bfloat16)
    x = torch.randn(1, k).to(torch.bfloat16)
    for _ in range(20):
        layer(x)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - t)
    return layer.layout, statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="1.5B")
    ap.add_argument("--main", choices=("Q4_K", "Q5_K"), default="Q4_K", help="Q4_K_M or Q5_K_M")
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    hidden, inter, heads, kv = SHAPES[a.shape]
    m = a.main
    projections = {
        "qkv, v Q6_K": [(m, heads * 128), (m, kv * 128), ("Q6_K", kv * 128)],
        f"qkv, v {m}": [(m, heads * 128), (m, kv * 128), (m, kv * 128)],
        "gate_up": [(m, inter), (m, inter)],
    }
    threads = torch.get_num_threads()
    print(f"{a.shape} {m}_M, 1 row, bf16, {threads} threads, µs a call (median of {a.reps})")
    for name, spec in projections.items():
        blocks = [(t, random_blocks(t, n, hidden, seed=i)) for i, (t, n) in enumerate(spec)]
        new = time_layer(_fuse([from_file(t, raw) for t, raw in blocks]), hidden, a.reps)
        old = time_layer(before(blocks), hidden, a.reps)
        print(
            f"{name:12s} blocks {new[1]:8.1f} ({new[0]})   before {old[1]:8.1f} ({old[0]})"
            f"   {old[1] / new[1]:.2f}x"
        )


if __name__ == "__main__":
    main()
