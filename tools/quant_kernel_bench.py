"""GPU time of the weight-only quantized linear kernels (kernels/triton/quant_matmul.py)
against bf16, at the Qwen2.5 0.5B and 7B projection shapes (fused qkv and gate_up).

Each timing is a CUDA graph of calls (tools/gpu_timing.py) that rotate over enough copies of
the weight (>= 192 MB in all) that none is still in L2 when its turn comes back, as in decode,
where every weight is read once per token. GB/s counts the bytes a call must read (packed
weights, scales and offsets, or the bf16 matrix). Formats:
  q4g32o   int4, groups of 32 with an offset, float32 scales (what GGUF Q4_K converts to)
  q4g128   int4, groups of 128, symmetric, float32 scales (quantize-on-load style)
  q4g128o  int4, groups of 128 with an offset, float32 scales (what quantization="int4"
           quantizes to on a GPU)
  q4g128h  the same as q4g128 with float16 scales (pack_for_triton(..., scale_dtype=...))
  q8g32    int8, groups of 32, symmetric, float32 scales (GGUF Q8_0's values)

Sections, printed as they finish:
  table    per shape and M in 1, 4, 16, 64: bf16 F.linear, the bf16 Triton GEMV (M=1), and
           each format with its default launch parameters
  stack    the batch-1 sum of one decoder layer's linears x layers + lm_head, bf16 as the
           model runs it (GEMV below GEMV_MAX_BYTES, fused SiLU·up) against each format
           (fused SiLU·up GEMV): the best estimate of the decode-speed ratio
  mma      the tensor-core int4 GEMV (q4g128, q4g128o) over K splits x stages, then rows x
           panels x stages, against the CUDA-core GEMV on the same weight; every config
           checked against the reference
  gemv     the q4g32o and q8g32 GEMV over rows x panels x warps (and the default's with 2
           and 4 stages), per shape: every time, the best, and the default's rank
  gemm     the q4g32o tensor-core GEMM at M 4, 16 and 64 over block_n x split_k x stages
  prefill  M 512 and 2048: the Triton GEMM against dequantize + cuBLAS (DEQUANT_MIN_M),
           outside the sweep budget

Usage: python3 tools/quant_kernel_bench.py [--shapes 0.5B,7B] [--tp 2] [--formats none]
           [--sections table,stack,mma,gemv,gemm,prefill] [--formats q4g32o,q4g128,...]
           [--sweep-budget-s 90] [--json PATH] [--only lm_head,qkv]

The sweeps stop --sweep-budget-s seconds after table and stack are done (each still times its
default launch parameters). --only keeps the linears it names, and drops the stack.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import time

import gpu_timing
import torch
import torch.nn.functional as F

from nanoqwen.kernels.triton.gemv import gemv, gemv_pays, gemv_silu_mul
from nanoqwen.kernels.triton.quant_gemm import GemmConfig, dequantize, gemm_config, launch_gemm
from nanoqwen.kernels.triton.quant_gemv import GemvConfig, gemv_config, sm_count
from nanoqwen.kernels.triton.quant_gemv_mma import MmaGemvConfig, mma_gemv_config
from nanoqwen.kernels.triton.quant_matmul import (
    PackedWeight,
    pack_for_triton,
    quant_linear,
    quant_linear_silu_mul,
)
from nanoqwen.kernels.triton.silu_mul import silu_mul
from nanoqwen.model.shapes import shape_config

ROTATE_BYTES = 192 << 20
# Formats the stack also times on the CUDA-core GEMV ("-cc"), the tensor-core one's baseline.
CUDA_CORE_TOO = ("q4g128", "q4g128o")
# name: (bits, group size, offset, float16 scales)
FORMATS = {
    "q4g32o": (4, 32, True, False),
    "q4g128": (4, 128, False, False),
    "q4g128o": (4, 128, True, False),
    "q4g128h": (4, 128, False, True),
    "q8g32": (8, 32, False, False),
}
DEV = torch.device("cuda")
BF16 = torch.bfloat16
RESULTS: dict[str, list] = {}
DEADLINE = [math.inf]
JSON_PATH: list[str] = []


def record(section: str, **row) -> None:
    RESULTS.setdefault(section, []).append(row)
    for path in JSON_PATH:  # rewritten each time, so a run cut short keeps what it measured
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=1)


def out_of_time() -> bool:
    return time.monotonic() > DEADLINE[0]


def shapes(name: str, tp: int = 1) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection on one of tp ranks: column-parallel ones split N,
    row-parallel ones (o, down) K, the lm_head its vocabulary rows."""
    cfg = shape_config(name)
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    return {
        "qkv": (qkv // tp, h),
        "o": (h, cfg.num_attention_heads * d // tp),
        "gate_up": (2 * cfg.intermediate_size // tp, h),
        "down": (h, cfg.intermediate_size // tp),
        "lm_head": (-(-cfg.vocab_size // tp), h),
    }


def copies_for(nbytes: int) -> int:
    return max(1, min(512, math.ceil(ROTATE_BYTES / nbytes)))


def over(fn, x: torch.Tensor, weights: list, **kw) -> list:
    """fn(x, w, **kw) for each weight copy w."""
    return [functools.partial(fn, x, w, **kw) for w in weights]


def silu_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return silu_mul(F.linear(x, w))


def dequant_linear(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    return F.linear(x, dequantize(w, x.dtype))


def timed(calls: list) -> float:
    """µs per call, the graph cycling through calls (one per weight copy)."""
    cycle = itertools.cycle(calls)
    reps = len(calls) * math.ceil(20 / len(calls))
    return gpu_timing.graph_us(lambda: next(cycle)(), reps=reps, iters=20)


def quantized(n: int, k: int, fmt: str) -> PackedWeight:
    bits, group, offset, half_scales = FORMATS[fmt]
    if bits == 4:
        q = torch.randint(0, 16, (n, k), device=DEV, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), device=DEV, dtype=torch.int8)
    scale = torch.rand(n, k // group, device=DEV) * 0.004 + 0.001
    if half_scales:
        scale = scale.half().float()
    off = -7.5 * scale if offset else None
    dtype = torch.float16 if half_scales else torch.float32
    return pack_for_triton(q, scale, off, group, bits, scale_dtype=dtype)


def clones(w: PackedWeight, count: int) -> list[PackedWeight]:
    out = [w]
    for _ in range(count - 1):
        t = {f: getattr(w, f) for f in ("qweight", "scales", "offsets")}
        out.append(dataclasses.replace(w, **{f: v.clone() for f, v in t.items() if v is not None}))
    return out


def gbps(nbytes: int, us: float) -> float:
    return nbytes / us / 1e3


class Shape:
    """One projection's bf16 weights and quantized formats, each in rotating copies."""

    def __init__(
        self, model: str, name: str, n: int, k: int, formats=tuple(FORMATS), tp: int = 1
    ) -> None:
        self.model, self.name, self.n, self.k, self.tp = model, name, n, k, tp
        w = torch.randn(n, k, device=DEV, dtype=BF16) * 0.02
        self.bf16 = [w] + [w.clone() for _ in range(copies_for(w.numel() * 2) - 1)]
        self.quant = {}
        for fmt in formats:
            packed = quantized(n, k, fmt)
            self.quant[fmt] = clones(packed, copies_for(packed.nbytes))

    def x(self, m: int) -> torch.Tensor:
        return torch.randn(m, self.k, device=DEV, dtype=BF16)

    def label(self) -> str:
        rank = f" (one of {self.tp} ranks)" if self.tp > 1 else ""
        return f"{self.model}{rank} {self.name} N={self.n} K={self.k}"

    def io_bytes(self, m: int) -> int:
        return 2 * m * (self.n + self.k)


def table(model: str, shape: Shape) -> None:
    for m in (1, 4, 16, 64):
        x = shape.x(m)
        wb = shape.n * shape.k * 2 + shape.io_bytes(m)
        row = {"bf16 F.linear": timed(over(F.linear, x, shape.bf16))}
        if m == 1:
            row["bf16 gemv"] = timed(over(gemv, x, shape.bf16))
        nbytes = {k: wb for k in row}
        for fmt, ws in shape.quant.items():
            row[fmt] = timed(over(quant_linear, x, ws))
            nbytes[fmt] = ws[0].nbytes + shape.io_bytes(m)
        best_bf16 = min(v for k, v in row.items() if k.startswith("bf16"))
        print(
            f"{shape.label()} M={m}: "
            + " | ".join(
                f"{k} {v:.1f} µs {gbps(nbytes[k], v):.0f} GB/s"
                + ("" if k.startswith("bf16") else f" x{best_bf16 / v:.2f}")
                for k, v in row.items()
            ),
            flush=True,
        )
        record("table", model=model, shape=shape.name, m=m, us=row)


def stack(model: str, built: dict[str, Shape]) -> None:
    """Batch-1 linears of the whole model: layers x (qkv + o + gate_up + down) + lm_head."""
    layers = shape_config(model).num_hidden_layers
    totals: dict[str, float] = {}
    for name, shape in built.items():
        x = shape.x(1)
        per = {}
        # gate_up runs with SiLU·up fused, and the lm_head on cuBLAS, as the engine runs them
        pays = gemv_pays(shape.bf16[0]) and name != "lm_head"
        if name == "gate_up":
            dense, quant = (gemv_silu_mul if pays else silu_linear), quant_linear_silu_mul
        else:
            dense, quant = (gemv if pays else F.linear), quant_linear
        per["bf16"] = timed(over(dense, x, shape.bf16))
        for fmt, ws in shape.quant.items():
            per[fmt] = timed(over(quant, x, ws))
            if fmt in CUDA_CORE_TOO:
                cfg = gemv_config(shape.n, shape.k, 4, sm_count(DEV))
                per[f"{fmt}-cc"] = timed(over(quant, x, ws, config=cfg))
        times = 1 if name == "lm_head" else layers
        for k, v in per.items():
            totals[k] = totals.get(k, 0.0) + times * v
        print(f"  stack part {model} {name} x{times}: "
              + " | ".join(f"{k} {v:.1f} µs" for k, v in per.items()), flush=True)  # fmt: skip
    base = totals["bf16"]
    tp = next(iter(built.values())).tp
    rank = f" (one of {tp} ranks)" if tp > 1 else ""
    print(
        f"{model}{rank} whole layer stack at batch 1 ({layers} layers x (qkv+o+gate_up+down) + "
        f"lm_head): bf16 (as the model runs it) {base / 1e3:.3f} ms | "
        + " | ".join(
            f"{k} {v / 1e3:.3f} ms x{base / v:.2f}" for k, v in totals.items() if k != "bf16"
        ),
        flush=True,
    )
    record("stack", model=model, ms={k: v / 1e3 for k, v in totals.items()})


def gemv_sweep(model: str, shape: Shape, fmt: str, warps: tuple[int, ...]) -> None:
    ws = shape.quant[fmt]
    x = shape.x(1)
    default = gemv_config(shape.n, shape.k, ws[0].bits, sm_count(DEV))
    times = {default: timed(over(quant_linear, x, ws, config=default))}
    grid = [GemvConfig(default.rows, default.panels, default.num_warps, st) for st in (2, 4)]
    grid += [GemvConfig(*c) for c in itertools.product((1, 2, 4, 8, 16), (4, 8, 16), warps)]
    for cfg in grid:
        if out_of_time():
            break
        if cfg not in times:
            times[cfg] = timed(over(quant_linear, x, ws, config=cfg))
    report_sweep("gemv", model, shape, fmt, 1, times, default, ws[0].nbytes)


def mma_sweep(model: str, shape: Shape, fmt: str) -> None:
    """The tensor-core GEMV's launch parameters, and the CUDA-core GEMV on the same weight."""
    ws = shape.quant[fmt]
    x = shape.x(1)
    cuda_core = gemv_config(shape.n, shape.k, 4, sm_count(DEV))
    ref = quant_linear(x, ws[0], config=cuda_core).float()
    old = timed(over(quant_linear, x, ws, config=cuda_core))
    default = mma_gemv_config(shape.n, shape.k)
    times, wrong = {}, []
    # The panels split over programs first (short, wide weights), then rows x panels.
    splits = itertools.product((2, 3, 4, 6, 8), (3, 4))
    grid = [default] + [dataclasses.replace(default, splits=k, num_stages=st) for k, st in splits]
    grid += [dataclasses.replace(default, max_registers=r) for r in (128, 96)]
    grid += [
        MmaGemvConfig(r, p, p, st)  # a warp a panel
        for r, p, st in itertools.product((16, 32, 64, 128), (4, 8), (3, 4))
    ]
    for cfg in grid:
        if cfg in times or (times and out_of_time()):
            continue
        try:
            y = quant_linear(x, ws[0], config=cfg).float()
        except Exception as e:  # noqa: BLE001 (a config that does not compile: report, go on)
            print(f"  mma {_short(cfg)} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        if not torch.allclose(y, ref, rtol=1e-2, atol=1e-2 * ref.abs().mean().item()):
            wrong.append(_short(cfg))
        times[cfg] = timed(over(quant_linear, x, ws, config=cfg))
    print(f"mma {shape.label()} {fmt}: cuda-core {old:.1f} µs | "
          + ("WRONG: " + ",".join(wrong) + " | " if wrong else ""), end="")  # fmt: skip
    report_sweep("mma", model, shape, fmt, 1, times, default, ws[0].nbytes)


def gemm_sweep(model: str, shape: Shape, fmt: str) -> None:
    ws = shape.quant[fmt]
    sms = sm_count(DEV)
    for m in (4, 16, 64):
        x = shape.x(m)
        default = gemm_config(m, shape.n, shape.k, ws[0].bits, sms)
        times = {default: timed(over(launch_gemm, x, ws, bias=None, config=default))}
        for bn, split, stages in itertools.product((32, 64, 128), (1, 2, 4, 8), (2, 4)):
            cfg = GemmConfig(default.block_m, bn, split, default.num_warps, stages)
            if out_of_time():
                break
            if cfg not in times:
                times[cfg] = timed(over(launch_gemm, x, ws, bias=None, config=cfg))
        report_sweep("gemm", model, shape, fmt, m, times, default, ws[0].nbytes)


def report_sweep(kind, model, shape, fmt, m, times, default, nbytes) -> None:
    if not times:
        print(f"{kind} sweep {shape.label()} {fmt} M={m}: skipped (time budget)", flush=True)
        return
    ranked = sorted(times.items(), key=lambda kv: kv[1])
    best_cfg, best = ranked[0]
    rank = [c for c, _ in ranked].index(default) + 1 if default in times else None
    print(
        f"{kind} sweep {shape.label()} {fmt} M={m}: best {best_cfg} {best:.1f} µs "
        f"{gbps(nbytes, best):.0f} GB/s; default {default} "
        + (f"{times[default]:.1f} µs (rank {rank}/{len(times)})" if rank else "not timed"),
        flush=True,
    )
    print("    " + " ".join(f"{_short(c)}={t:.1f}" for c, t in ranked), flush=True)
    record(
        f"{kind}_sweep", model=model, shape=shape.name, fmt=fmt, m=m,
        us={_short(c): t for c, t in times.items()}, default=_short(default),
    )  # fmt: skip


def _short(cfg) -> str:
    if isinstance(cfg, MmaGemvConfig):
        split = f"k{cfg.splits}" if cfg.splits > 1 else ""
        cap = f"n{cfg.max_registers}" if cfg.max_registers else ""
        return f"r{cfg.rows}p{cfg.panels}w{cfg.num_warps}st{cfg.num_stages}{split}{cap}"
    if isinstance(cfg, GemvConfig):
        return f"r{cfg.rows}p{cfg.panels}w{cfg.num_warps}st{cfg.num_stages}"
    return f"m{cfg.block_m}n{cfg.block_n}s{cfg.split_k}w{cfg.num_warps}st{cfg.num_stages}"


def prefill(model: str, shape: Shape) -> None:
    for m in (512, 2048):
        x = shape.x(m)
        row = {"bf16 F.linear": timed(over(F.linear, x, shape.bf16[:2]))}
        for fmt in ("q4g32o", "q8g32"):
            ws = shape.quant[fmt][:2]
            cfg = gemm_config(m, shape.n, shape.k, ws[0].bits, sm_count(DEV))
            row[f"{fmt} triton"] = timed(over(launch_gemm, x, ws, bias=None, config=cfg))
            row[f"{fmt} dequant+cuBLAS"] = timed(over(dequant_linear, x, ws))
        print(f"prefill {shape.label()} M={m}: "
              + " | ".join(f"{k} {v:.1f} µs" for k, v in row.items()), flush=True)  # fmt: skip
        record("prefill", model=model, shape=shape.name, m=m, us=row)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="0.5B,7B")
    p.add_argument("--sections", default="table,stack,mma,gemv,gemm,prefill")
    p.add_argument("--formats", default=",".join(FORMATS), help="'none': bf16 only")
    p.add_argument("--tp", type=int, default=1, help="one rank's shards at this tp size")
    p.add_argument(
        "--sweep-budget-s", type=float, default=90.0,
        help="seconds for the sweeps, counted once table and stack are done",
    )  # fmt: skip
    p.add_argument("--json", help="also write every figure here")
    p.add_argument("--only", help="these linears alone, e.g. lm_head or qkv,o")
    args = p.parse_args()
    JSON_PATH.extend([args.json] if args.json else [])
    sections = set(args.sections.split(","))
    print(f"{torch.cuda.get_device_name()}, {sm_count(DEV)} SMs", flush=True)
    models = {}
    for model in args.shapes.split(","):
        formats = () if args.formats == "none" else tuple(args.formats.split(","))
        built = {
            name: Shape(model, name, n, k, formats, args.tp)
            for name, (n, k) in shapes(model, args.tp).items()
            if not args.only or name in args.only.split(",")
        }
        models[model] = built
        if "table" in sections:
            for shape in built.values():
                table(model, shape)
        if "stack" in sections and not args.only:
            stack(model, built)
    # Sweeps, the largest model first: what they miss once over budget matters least.
    DEADLINE[0] = time.monotonic() + args.sweep_budget_s
    order = list(reversed(models.items()))
    if "mma" in sections:
        for fmt in ("q4g128o", "q4g128"):
            for model, built in order:
                for shape in built.values():
                    if fmt in shape.quant:
                        mma_sweep(model, shape, fmt)
    if "gemv" in sections:
        for model, built in order:
            for shape in built.values():
                gemv_sweep(model, shape, "q4g32o", warps=(2, 4, 8))
    if "prefill" in sections:
        for model, built in order:
            for name in ("gate_up", "down"):
                if name in built:
                    prefill(model, built[name])
    if "gemm" in sections:
        for model, built in order:
            for name in ("qkv", "down"):
                if name in built:
                    gemm_sweep(model, built[name], "q4g32o")
    if "gemv" in sections:
        for model, built in order:
            for shape in built.values():
                gemv_sweep(model, shape, "q8g32", warps=(4,))


if __name__ == "__main__":
    main()
