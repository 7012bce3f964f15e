"""The model's projections as cuBLAS runs them (F.linear, bf16): TFLOP/s and kernel per M.

Prefill steps of different token counts get different cuBLAS kernels; this shows which M a
prefill budget should aim for. Decode batch sizes are timed as well (bandwidth-bound there).

Usage (device): python3 tools/gemm_bench.py --shape 7B [--m 64,128,256,4096,8192,16384]
                python3 tools/gemm_bench.py --only gate_up,down --m 4096:16384:512 --data halfzero
--data: the activations' values (randn, or half of each row zeros: the tensor cores' power
draw, and so the clock under the power cap, depends on the bits they multiply).
"""

from __future__ import annotations

import argparse

import gpu_timing
import torch
import torch.nn.functional as F
from quant_kernel_bench import shapes


def kernel_name(fn) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return " + ".join(n[:70] for n in names)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="7B")
    p.add_argument("--m", default="64,128,256,2048,4096,6144,8192,12288,15873,16384")
    p.add_argument("--only", default="", help="comma-separated projections")
    p.add_argument("--data", choices=("randn", "halfzero"), default="randn")
    args = p.parse_args()
    if ":" in args.m:
        lo, hi, step = (int(v) for v in args.m.split(":"))
        ms = list(range(lo, hi + 1, step))
    else:
        ms = [int(v) for v in args.m.split(",")]
    torch.manual_seed(0)
    total: dict[int, float] = {}
    for name, (n, k) in shapes(args.shape).items():
        if name == "lm_head" or (args.only and name not in args.only.split(",")):
            continue
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        bias = torch.zeros(n, device="cuda", dtype=torch.bfloat16) if name == "qkv" else None
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            if args.data == "halfzero":
                x[:, k // 2 :] = 0
            fn = lambda x=x, w=w, b=bias: F.linear(x, w, b)  # noqa: E731
            reps = 20 if m <= 1024 else 2
            us = gpu_timing.graph_us(fn, reps=reps, iters=10)
            total[m] = total.get(m, 0.0) + us
            tflops = 2 * m * k * n / us / 1e6
            tbps = 2 * (n * k + m * k + m * n) / us / 1e6
            print(
                f"{name:8s} M={m:6d} K={k:6d} N={n:6d} {us:9.1f} us {tflops:6.0f} TFLOP/s "
                f"{tbps:5.2f} TB/s  {kernel_name(fn)}",
                flush=True,
            )
    for m, us in total.items():
        print(f"layer GEMMs M={m:6d}: {us:9.1f} us, {us / m * 1e3:8.2f} ns per token")


if __name__ == "__main__":
    main()
