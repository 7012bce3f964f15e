"""What a kernel boundary costs at batch 1: a chain of small Triton kernels, each reading the
one before's output, replayed from a CUDA graph, µs a kernel. A 0.5B decode step has ~5 such
boundaries a layer (120 a step), so this floor times 120 is what fusing across boundaries
could take off the step.

Each kernel has PROGRAMS programs; each reads one value the kernel before wrote and writes
one (so every boundary is a true dependency). Variants: launched normally; as programmatic
dependents (kernels/triton/pdl.py) that let the next kernel launch at their start, or after
their work; and the same with WORK bytes of an independent read a program before the wait
(a weight tile, as the GEMVs do).

Usage (device): python3 tools/pdl_chain_bench.py [--kernels 200] [--programs 32,128,512]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from gpu_timing import graph_us
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _link_kernel(
    src_ptr, dst_ptr, weight_ptr, WORK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr
):
    pid = tl.program_id(0)
    if PDL:  # noqa: SIM102 (compile-time guards)
        if EARLY:
            gdc_launch_dependents()
    w = 0.0
    if WORK > 0:
        offs = pid * WORK + tl.arange(0, WORK)
        w = tl.sum(tl.load(weight_ptr + offs).to(tl.float32), axis=0)
    if PDL:
        gdc_wait()
    v = tl.load(src_ptr + pid)
    if PDL:  # noqa: SIM102
        if not EARLY:
            gdc_launch_dependents()
    tl.store(dst_ptr + pid, v + 1.0 + w * 0.0)


def chain_us(kernels: int, programs: int, work: int, pdl: bool, early: bool) -> float:
    """µs a kernel of a chain of `kernels` links, from a CUDA graph."""
    bufs = [torch.zeros(programs, device="cuda") for _ in range(2)]
    # Each link reads its own weights, so they come from memory as a model's do.
    weights = [
        torch.randn(programs * max(work, 1), device="cuda", dtype=torch.bfloat16)
        for _ in range(kernels if work else 1)
    ]

    def run():
        for i in range(kernels):
            src, dst = bufs[i % 2], bufs[(i + 1) % 2]
            _link_kernel[(programs,)](
                src, dst, weights[i % len(weights)], WORK=work, PDL=pdl, EARLY=early,
                launch_pdl=pdl, num_warps=4,
            )  # fmt: skip

    return graph_us(run, reps=1, iters=20) / kernels


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", type=int, default=200)
    p.add_argument("--programs", default="32,128,512")
    p.add_argument("--work", default="0,4096", help="bf16 elements a program reads first")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), triton.__version__, flush=True)
    for programs in (int(v) for v in args.programs.split(",")):
        for work in (int(v) for v in args.work.split(",")):
            row = {
                "normal": chain_us(args.kernels, programs, work, False, False),
                "pdl, next launches at start": chain_us(args.kernels, programs, work, True, True),
                "pdl, next launches after the read": chain_us(
                    args.kernels, programs, work, True, False
                ),
            }
            print(
                f"{programs} programs, {work * 2} B read first: "
                + " | ".join(f"{k} {v:.2f} µs" for k, v in row.items()),
                flush=True,
            )


if __name__ == "__main__":
    main()
