"""CPU time of the GGUF few-row kernels (nanoqwen/kernels/cpu/gguf_gemv.c, gguf_kquants.c) on
the default model's layer 0 and lm_head, at the row counts of decode (1) and of speculative
verify steps (8, 16), as the layers run them (rows past a kernel's limit in passes).

With --baseline DIR (a copy of nanoqwen/kernels/cpu's C files from another commit, e.g.
`git show REV:nanoqwen/kernels/cpu/gguf_gemv.c > DIR/gguf_gemv.c` for each of gguf_gemv.c,
gguf_kquants.c, gguf_common.h, bf16.h and, where REV has it, gguf_requantize.h) that commit's
kernels (file-layout weights, 8 rows a pass) take turns with this checkout's, call by call,
in one process: a shared machine's drift slows both alike. Each figure is the fastest of
--reps calls (a call that another job's thread interrupts waits out its time slice). The
weights of one layer fit in the L3 cache; --stack times every layer's projections in turn
(~256 MB, streamed from memory as in decode).

    python3 tools/gemv_rows_bench.py [--rows 1,8,16] [--reps 20] [--baseline DIR] [--stack]
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import torch
from gguf import GGUFReader

from nanoqwen.kernels.cpu import gguf as kernels
from nanoqwen.kernels.cpu.build import load_library
from nanoqwen.kernels.cpu.gguf_lanes import LANE_KINDS, to_lanes
from nanoqwen.quant.gguf_packed import PackedBlocks, cat_packed, from_file

GGUF = Path("weights/.cache/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
WEIGHTS = {  # name: the file's tensors, stacked as the model fuses them
    "qkv": ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"],
    "o": ["blk.0.attn_output.weight"],
    "gate_up": ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"],
    "down": ["blk.0.ffn_down.weight"],  # Q6_K
    "down_11": ["blk.11.ffn_down.weight"],  # Q4_K
    "lm_head": ["output.weight"],
}


def load() -> dict[str, PackedBlocks]:
    tensors = {t.name: t for t in GGUFReader(GGUF).tensors}
    found = {}
    for name, parts in WEIGHTS.items():
        blocks = [from_file(tensors[p].tensor_type.name, tensors[p].data) for p in parts]
        found[name] = cat_packed(blocks)
    return found


def baseline_call(lib: ctypes.CDLL, kind: str, tensors: tuple, max_rows: int):
    """The baseline library's kernel for kind, in passes of max_rows rows."""
    name = kernels._KERNELS[kind][1].replace("_lanes", "")  # the kernel before lanes
    fn = getattr(lib, name)
    fn.restype = ctypes.c_int

    def call(x: torch.Tensor) -> torch.Tensor:
        n = tensors[0].shape[0]
        outs = []
        for rows in x.split(max_rows):
            out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
            ptrs = [ctypes.c_void_p(t.data_ptr()) for t in tensors]
            m, k, n_ = (ctypes.c_int64(v) for v in (rows.shape[0], rows.shape[1], n))
            x_ptr, y_ptr = ctypes.c_void_p(rows.data_ptr()), ctypes.c_void_p(out.data_ptr())
            status = fn(x_ptr, 1, m, k, *ptrs, n_, y_ptr, 1, None, torch.get_num_threads())
            assert status == 0
            outs.append(out)
        return torch.cat(outs)

    return call


def current_call(kind: str, tensors: tuple):
    planes = kernels.fifth_bit_planes()
    packed = to_lanes(kind, tensors, planes=planes) if kind in LANE_KINDS else tensors
    max_rows = kernels.max_rows(kind)

    def call(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([kernels.gguf_matmul(r, kind, packed) for r in x.split(max_rows)])

    return call


def stack() -> list[PackedBlocks]:
    """Every layer's projections (fused as the model fuses them), in the model's order."""
    tensors = {t.name: t for t in GGUFReader(GGUF).tensors}
    found = []
    for i in range(sum(name.endswith("ffn_down.weight") for name in tensors)):
        for names in (["attn_q", "attn_k", "attn_v"], ["attn_output"], ["ffn_gate", "ffn_up"],
                      ["ffn_down"]):  # fmt: skip
            parts = [tensors[f"blk.{i}.{n}.weight"] for n in names]
            found.append(cat_packed([from_file(t.tensor_type.name, t.data) for t in parts]))
    return found


def timed(calls: dict, x_of, reps: int) -> dict[str, float]:
    """The fastest of reps turns (ms) of each call, the calls taking turns: a call that
    another job's thread interrupts waits out its time slice, so the fastest is the least
    disturbed."""
    times = {k: [] for k in calls}
    for _ in range(reps):
        for k, c in calls.items():
            t = time.perf_counter()
            c(x_of)
            times[k].append(time.perf_counter() - t)
    return {k: min(v) * 1e3 for k, v in times.items()}


def line(label: str, ms: dict[str, float]) -> str:
    text = f"{label}: " + "  ".join(f"{k} {v:7.3f} ms" for k, v in ms.items())
    return text + (f"  (base/now {ms['base'] / ms['now']:.2f}x)" if "base" in ms else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--baseline", type=Path)
    ap.add_argument("--stack", action="store_true", help="every layer's weights in turn")
    args = ap.parse_args()
    base = {}
    if args.baseline:
        base["gemv"] = load_library(args.baseline / "gguf_gemv.c", "baseline")
        base["kq"] = load_library(args.baseline / "gguf_kquants.c", "baseline")

    def calls_of(w: PackedBlocks) -> dict:
        lib = base.get("kq" if w.kind in kernels.SUPERBLOCK_KINDS else "gemv")
        calls = {"now": current_call(w.kind, w.tensors)}
        if lib is not None:
            calls["base"] = baseline_call(lib, w.kind, w.tensors, 8)
        return calls

    if args.stack:  # ~256 MB: streamed from memory, as a decode or verify step reads them
        layers = [(w.shape[1], calls_of(w)) for w in stack()]
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k).bfloat16() for k, _ in layers}
            names = layers[0][1].keys()
            turns = {k: (lambda xs, k=k: [c[k](xs[n]) for n, c in layers]) for k in names}
            print(line(f"{len(layers) // 4} layers rows {rows:2d}", timed(turns, xs, args.reps)))
        return
    for name, w in load().items():
        calls = calls_of(w)
        reps = max(2, args.reps // 5) if name == "lm_head" else args.reps
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
            x = x.bfloat16()
            outs = {k: c(x) for k, c in calls.items()}  # warm
            text = line(f"{name:8s} {w.kind:5s} rows {rows:2d}", timed(calls, x, reps))
            if "base" in outs:
                text += (
                    f" max |diff| {(outs['now'].float() - outs['base'].float()).abs().max():.3g}"
                )
            print(text, flush=True)


if __name__ == "__main__":
    main()
