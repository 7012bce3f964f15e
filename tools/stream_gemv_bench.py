"""The streamed batch-1 GEMV (kernels/triton/stream_gemv.py) against cuBLAS at 7B's projection
shapes, over its launch parameters: µs a call and TB/s of weight, each call in a CUDA graph
that rotates over enough weight copies that none is still in L2 (tools/quant_kernel_bench.py's
timing), as in decode. gate_up runs with SiLU·up, cuBLAS's with the SiLU·up kernel after it;
the lm_head gives float32 logits, cuBLAS's as the model asks it (torch.mm, out_dtype).

Usage (device): python3 tools/stream_gemv_bench.py [--shapes 7B] [--only qkv,lm_head]
                [--budget-s 150]
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F
from quant_kernel_bench import Shape, over, shapes, silu_linear, timed

from nanoqwen.kernels.triton.stream_gemv import StreamGemvConfig, stream_gemv, stream_gemv_config


def stream(x, w, silu_mul: bool, config: StreamGemvConfig | None, out_dtype=None):
    return stream_gemv(x, w, silu_mul=silu_mul, config=config, out_dtype=out_dtype)


def logits(x, w):
    return torch.mm(x, w.t(), out_dtype=torch.float32)


def sweep(model: str, shape: Shape, deadline: float) -> None:
    silu = shape.name == "gate_up"
    out = torch.float32 if shape.name == "lm_head" else None
    x = shape.x(1)
    nbytes = shape.n * shape.k * 2
    library = silu_linear if silu else logits if out else F.linear
    cublas = timed(over(library, x, shape.bf16))
    default = stream_gemv_config(shape.n // 2 if silu else shape.n, shape.k)
    kw = dict(silu_mul=silu, out_dtype=out)
    times = {default: timed(over(stream, x, shape.bf16, config=None, **kw))}
    grid = itertools.product((16, 8, 32), (256, 128), (1, 2, 3, 4, 6), (4, 3, 6))
    for rows, cols, splits, stages in grid:
        if time.monotonic() > deadline:
            break
        cfg = StreamGemvConfig(rows, cols, splits, stages)
        if cfg in times:
            continue
        try:
            times[cfg] = timed(over(stream, x, shape.bf16, config=cfg, **kw))
        except Exception as e:  # noqa: BLE001 (out of shared memory: report, go on)
            print(f"  {cfg} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
    ranked = sorted(times.items(), key=lambda kv: kv[1])
    tbps = lambda us: nbytes / us / 1e6  # noqa: E731
    print(
        f"{shape.label()}: cuBLAS {cublas:.1f} µs ({tbps(cublas):.2f} TB/s) | stream default "
        f"{times[default]:.1f} µs ({tbps(times[default]):.2f} TB/s) | best "
        + "; ".join(
            f"r{c.rows} c{c.cols} k{c.splits} st{c.num_stages} {t:.1f} ({tbps(t):.2f})"
            for c, t in ranked[:5]
        ),
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="7B")
    p.add_argument("--only", default="qkv,o,gate_up,down,lm_head", help="projections")
    p.add_argument("--budget-s", type=float, default=150.0, help="seconds for all the sweeps")
    args = p.parse_args()
    models = args.shapes.split(",")
    names = args.only.split(",")
    per_shape = args.budget_s / (len(models) * len(names))
    for model in models:
        for name, (n, k) in shapes(model).items():
            if name in names:
                sweep(model, Shape(model, name, n, k, ()), time.monotonic() + per_shape)


if __name__ == "__main__":
    main()
