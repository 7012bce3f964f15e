"""GPU time of the batch-1 GEMV chain of a decoder layer (kernels/triton/gemv.py), as decode
runs it: norm+qkv, o_proj, norm+gate_up with SiLU·up, down_proj, over every layer's own
weights (so they stream from memory, not L2), captured in a CUDA graph, launched as
programmatic dependents where the GPU has them. Attention is left out: o_proj reads q's
first rows.

    python3 tools/gemv_chain_bench.py [--shape 0.5B] [--sweep]

--sweep times each projection's (rows a program, warps) choices with the others at the
default, and prints µs a layer for each, fastest first.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from gpu_timing import graph_us

from nanoqwen.kernels.triton import gemv
from nanoqwen.model.shapes import shape_config

ROWS, WARPS = (1, 2, 4, 8, 16), (2, 4, 8)


def layer_weights(cfg, layers: int):
    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv_n = cfg.q_size + 2 * cfg.kv_size
    kw = dict(dtype=torch.bfloat16, device="cuda")

    def rand(*shape):
        return torch.randn(*shape, **kw) * 0.02

    return [
        dict(qkv=rand(qkv_n, h), qkv_b=rand(qkv_n), o=rand(h, cfg.q_size),
             gate_up=rand(2 * i, h), down=rand(h, i), n1=1 + rand(h), n2=1 + rand(h))
        for _ in range(layers)
    ]  # fmt: skip


def chain(weights, x, eps: float = 1e-6):
    def run():
        h, res = x, None
        for w in weights:
            qkv, res = gemv.norm_gemv(h, res, w["n1"], eps, w["qkv"], w["qkv_b"])
            attn = gemv.gemv(qkv[:, : w["o"].shape[1]].contiguous(), w["o"])
            act, res = gemv.norm_gemv_silu_mul(attn, res, w["n2"], eps, w["gate_up"])
            h = gemv.gemv(act, w["down"])
        return h

    return run


def timed(weights, x, choices: dict) -> float:
    """µs a layer with choices {weight shape: (rows, warps)} in place of the defaults."""
    blocks, warps = gemv._blocks, gemv._warps

    def patched_blocks(n, k):
        rows, cols = blocks(n, k)
        for (cn, ck), (r, _) in choices.items():
            if (n, k) == (cn, ck):
                # gemv_silu_mul gives a program half these rows of gate and as many of up
                rows = r * (2 if n == 2 * weights[0]["down"].shape[1] else 1)
                cols = gemv.columns(k, rows)
        return rows, cols

    def patched_warps(n, k):
        return choices.get((n, k), (None, warps(n, k)))[1]

    gemv._blocks, gemv._warps = patched_blocks, patched_warps
    try:
        return graph_us(chain(weights, x), reps=3, iters=20) / len(weights)
    finally:
        gemv._blocks, gemv._warps = blocks, warps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="0.5B")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--sweep", action="store_true")
    args = p.parse_args()
    cfg = shape_config(args.shape)
    weights = layer_weights(cfg, args.layers)
    x = torch.randn(1, cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
    print(f"{args.shape}: default {timed(weights, x, {}):.2f} µs a layer")
    if not args.sweep:
        return
    w = weights[0]
    for name in ("qkv", "o", "gate_up", "down"):
        shape = tuple(w[name].shape)
        results = []
        for rows, warps in itertools.product(ROWS, WARPS):
            try:
                results.append((timed(weights, x, {shape: (rows, warps)}), rows, warps))
            except Exception as e:  # a choice that does not compile (registers, shared memory)
                print(f"  {name} rows {rows} warps {warps}: {type(e).__name__}")
        results.sort()
        print(f"{name} {shape}: " + ", ".join(f"{r}x{wp} {t:.2f}" for t, r, wp in results[:8]))


if __name__ == "__main__":
    main()
