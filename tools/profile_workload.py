"""Where a whole pair.py workload's GPU time goes, for nanoqwen or the peer (nano-vllm).

Usage (device, .peer and .whl carried, flash-attn installed):
    python3 tools/profile_workload.py --engine nanoqwen --shape 7B --workload throughput
    python3 tools/profile_workload.py --engine nano-vllm --shape 7B --workload throughput
    python3 tools/profile_workload.py --max-num-batched-tokens 16384   # nano-vllm's budget

Runs the workload once unprofiled (warm-up, and the wall time without the profiler's cost),
then once under torch.profiler recording CUDA kernels only, with every token id shifted by
one so that neither engine's prefix cache serves the second run from the first. Prints the
wall time, the summed kernel time, and kernel time by kind (GEMM, attention, norm, sampling,
...) and by name, so two engines' tables can be set side by side.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

import torch

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".peer")
KINDS = [  # first match wins: flash-attn's names contain "cutlass" and "Flash_fwd_kernel_traits"
    # too; its paged prefill (varlen with a block table) also runs the splitkv kernel
    ("attention splitkv", r"splitkv|flash_fwd_split|decode_|combine|merge_"),
    ("attention prefill", r"flash_fwd_kernel|prefill_attention"),
    ("gemv (triton)", r"gemv"),
    ("gemm", r"gemm|xmma|cutlass|cublas|nvjet"),
    ("norm", r"rms|norm|mean_mul_pow_rsqrt"),
    ("rope / kv write", r"rope|rotary|store_kv|cat_index_mul_split"),
    ("activation", r"silu"),
    ("sampling", r"sampl|gumbel|softmax|exponential|argmax|topk|threshold|penal|prepare"),
    ("copy / cast", r"copy|cast|fill|index|gather|scatter|elementwise|vectorized"),
]


def kind(name: str) -> str:
    low = name.lower()
    for label, pattern in KINDS:
        if re.search(pattern, low):
            return label
    return "other"


def make_llm(engine: str, path: str, **ours_kwargs):
    if engine == "nano-vllm":
        sys.path.insert(0, PEER)
        from nanovllm import LLM, SamplingParams

        return LLM(path, enforce_eager=False, max_model_len=4096), SamplingParams, False
    from nanoqwen import LLM, SamplingParams

    llm = LLM(path, device="cuda", dtype="bfloat16", progress=False, **ours_kwargs)
    return llm, SamplingParams, True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("nanoqwen", "nano-vllm"), default="nanoqwen")
    ap.add_argument("--shape", default="7B")
    ap.add_argument("--workload", default="throughput")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--max-num-batched-tokens", type=int, help="nanoqwen's prefill budget")
    args = ap.parse_args()
    kwargs = {}
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    sys.path.insert(0, PEER)
    from pair import model_dir, workload

    llm, SamplingParams, ours = make_llm(args.engine, model_dir(args.shape), **kwargs)
    prompts, outs = workload(args.workload)
    sps = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in outs]
    warm = {} if ours else {"use_tqdm": False}
    llm.generate([prompts[0][:100]], [SamplingParams(temperature=0.6, max_tokens=8)], **warm)
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, sps, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    print(
        f"{args.engine} {args.shape} {args.workload}: {wall:.3f} s unprofiled, "
        f"{sum(outs) / wall:,.1f} output tok/s"
    )
    prompts = [[(t + 1) % 10_001 for t in p] for p in prompts]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        llm.generate(prompts, sps, use_tqdm=False)
        torch.cuda.synchronize()
        wall_prof = time.perf_counter() - t
    by_name: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by_name[ev.name] += ev.device_time
            calls[ev.name] += 1
    total = sum(by_name.values()) / 1e6
    by_kind: collections.Counter[str] = collections.Counter()
    for name, us in by_name.items():
        by_kind[kind(name)] += us
    print(
        f"profiled: {wall_prof:.3f} s wall, {total:.3f} s of kernels "
        f"({100 * total / wall_prof:.1f}% of wall)"
    )
    for label, us in by_kind.most_common():
        print(f"  {label:20s} {us / 1e6:8.3f} s  {100 * us / 1e6 / total:5.1f}%")
    print("kernels:")
    for name, us in by_name.most_common(args.top):
        print(f"  {us / 1e6:8.3f} s {calls[name]:8d} calls  {name[:150]}")


if __name__ == "__main__":
    main()
