"""What a kernel boundary costs at batch 1: a chain of small Triton kernels, each reading the
one before's output, replayed from a CUDA graph, µs a kernel. A 0.5B decode step has ~5 such
boundaries a layer (120 a step), so this floor times 120 is what fusing across boundaries
could take off the step.

Each kernel has PROGRAMS programs; each reads one value the kernel before wrote and writes
one (so every boundary is a true dependency). Variants: launched normally; as programmatic
dependents (kernels/triton/pdl.py) that let the next kernel launch at their start, or after
their work; and the same with WORK bytes of an independent read a program before the wait
(a weight tile, as the GEMVs do).

Against them, what a persistent kernel over the layers would pay instead (the megakernel
design): the same chain as the phases of one launch, each program reading a value another
program wrote in the phase before, a grid-wide barrier between phases (an atomic count each
program adds to and polls), its WORK read before it polls. Only for grids the GPU holds at
once (at most one program an SM here): a program waiting on one not yet placed would wait
forever, so each poll gives up after MAX_SPINS and the run says so. GPU only: Triton's
interpreter runs one program after another.

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


MAX_SPINS = tl.constexpr(1 << 14)  # a few ms: a phase hands over in a few µs


@triton.jit
def _wait_for(counter_ptr, target, failed_ptr):
    """Polls the count (uncached loads) until it reaches target, then acquires it: the
    stores counted in before are visible after. Gives up after MAX_SPINS, marking failed."""
    seen = tl.load(counter_ptr, volatile=True)
    spins = 0
    while (seen < target) & (spins < MAX_SPINS):
        seen = tl.load(counter_ptr, volatile=True)
        spins += 1
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.atomic_max(failed_ptr, (seen < target).to(tl.int32))


@triton.jit
def _phases_kernel(buf_ptr, weight_ptr, counter_ptr, failed_ptr, phases, programs,
                   WORK: tl.constexpr):  # fmt: skip
    """The chain as `phases` phases of one launch, a grid barrier between them."""
    pid = tl.program_id(0)
    for phase in range(phases):
        w = 0.0
        if WORK > 0:
            offs = (phase * programs + pid).to(tl.int64) * WORK + tl.arange(0, WORK)
            w = tl.sum(tl.load(weight_ptr + offs).to(tl.float32), axis=0)
        if phase > 0:
            _wait_for(counter_ptr, phase * programs, failed_ptr)
        src = buf_ptr + (phase % 2) * programs
        dst = buf_ptr + ((phase + 1) % 2) * programs
        v = tl.load(src + (pid + 1) % programs, cache_modifier=".cg")  # another program's
        tl.store(dst + pid, v + 1.0 + w * 0.0)
        tl.debug_barrier()  # every thread's store before the one thread's release
        tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


def phases_us(phases: int, programs: int, work: int) -> float | None:
    """µs a phase of one launch of `phases` phases, from a CUDA graph; None where a poll
    gave up (programs the GPU could not hold at once)."""
    buf = torch.zeros(2 * programs, device="cuda")
    weights = torch.randn(phases * programs * max(work, 1), device="cuda", dtype=torch.bfloat16)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    failed = torch.zeros(1, dtype=torch.int32, device="cuda")

    def run():
        counter.zero_()
        _phases_kernel[(programs,)](buf, weights, counter, failed, phases, programs, WORK=work,
                                    num_warps=4)  # fmt: skip

    us = graph_us(run, reps=1, iters=20) / phases
    return None if failed.item() else us


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
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for programs in (int(v) for v in args.programs.split(",")):
        for work in (int(v) for v in args.work.split(",")):
            row = {
                "normal": chain_us(args.kernels, programs, work, False, False),
                "pdl, next launches at start": chain_us(args.kernels, programs, work, True, True),
                "pdl, next launches after the read": chain_us(
                    args.kernels, programs, work, True, False
                ),
            }
            if programs <= sms:
                row["one launch, grid barriers"] = phases_us(args.kernels, programs, work)
            print(
                f"{programs} programs, {work * 2} B read first: "
                + " | ".join(
                    f"{k} " + ("gave up" if v is None else f"{v:.2f} µs") for k, v in row.items()
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
