"""SASS instructions a weight in the main loop of the quant GEMVs, without a GPU.

Compiles kernels/triton/quant_gemv.py (CUDA cores) and kernels/triton/quant_gemv_mma.py
(tensor cores) for sm_90 with Triton's bundled ptxas (arguments specialized as a launch on
16-byte aligned tensors would be), disassembles them with its nvdisasm and counts the
instructions between the loop's label and its backward branch, per weight a thread handles in
one loop step.
The figures in those modules' docstrings come from here; the opcode histogram says where
the rest goes. `--shape 7B` adds the tensor-core GEMV of each projection with the launch
parameters the engine picks at batch 1 (mma_gemv_config, launched as a programmatic
dependent), its loop's instructions sorted into what they do: unpacking the codes, the
tensor-core dots (with the x sums), reading x's operand out of shared memory, register
moves, and the rest (addresses, loop control, the copies' issue, scales).

Usage: python3 tools/quant_gemv_sass.py [--top 8] [--shape 7B]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

from triton.tools import disasm

from nanoqwen.kernels.triton import quant_gemv, quant_gemv_mma

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels" / "triton"))
import quant_kernel_bench  # noqa: E402  (tools/, beside this script)
import sm90_compile  # noqa: E402

POINTER_TYPES = {"x_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "qw_ptr": "*i32",
                 "counts_ptr": "*i32"}  # fmt: skip
DIVISIBLE = ("N", "K", "KW")  # what a launch specializes as multiples of 16, with pointers


def _types(fn, const: dict) -> dict[str, str]:
    """Every argument of fn not in const: an int32, or a pointer where its name ends in _ptr
    (float32 unless POINTER_TYPES says otherwise)."""
    return {
        name: POINTER_TYPES.get(name, "*fp32") if name.endswith("_ptr")
        else "i32:16" if name in DIVISIBLE else "i32"
        for name in fn.arg_names
        if name not in const
    }  # fmt: skip


def compile_sm90(fn, const: dict, warps: int, stages: int, maxnreg: int | None = None):
    """fn through sm90_compile.compile_kernel with _types' argument types."""
    return sm90_compile.compile_kernel(fn, _types(fn, const), const, warps, stages, maxnreg)


def loop_opcodes(sass: str, suffixes: bool = False) -> collections.Counter:
    """Opcodes of the first loop (label .. backward branch to it); with suffixes, as
    LDS.U8 rather than LDS."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, x in enumerate(lines) if (m := re.match(r"^(\w+):\s*$", x))}
    for i, line in enumerate(lines):
        m = re.search(r"BRA (\w+);", line)
        if m and labels.get(m.group(1), i) < i:
            ops = collections.Counter()
            for x in lines[labels[m.group(1)] + 1 : i + 1]:
                if "\t" in x:
                    ins = re.sub(r"^@!?U?P\w+\s+", "", x.split("\t", 1)[1].strip())
                    op = ins.split()[0].rstrip(";")
                    ops[op if suffixes else op.split(".")[0]] += 1
            return ops
    raise ValueError("no loop found")


# What a loop instruction of the tensor-core GEMV does, by opcode (with suffixes): the rest
# is addressing, loop control, the copies' issue and the scales.
ROLES = {
    "unpack": ("LOP3.LUT", "SHF.R.U32.HI"),
    "dots": ("HMMA.16816.F32.BF16", "HMMA.16816.F32"),
    "x operand": ("LDS.U16", "PRMT"),
    "moves": ("IMAD.MOV.U32", "MOV"),
}


def report(label: str, kernel, weights_per_thread: int, top: int, roles: bool = False) -> None:
    ops = loop_opcodes(disasm.get_sass(kernel.asm["cubin"]), suffixes=roles)
    total = sum(ops.values())
    if roles:
        parts = {role: sum(ops[op] for op in names) for role, names in ROLES.items()}
        parts["other"] = total - sum(parts.values())
        common = ", ".join(f"{role} {n}" for role, n in parts.items())
    else:
        common = ", ".join(f"{op} {n}" for op, n in ops.most_common(top))
    print(f"{label}: {total / weights_per_thread:.2f} a weight ({total} / {weights_per_thread}); "
          f"{common}")  # fmt: skip


# The product alone: no residual add, no norm scale (model/summed_row.py's launches add a
# few instructions after the loop, none in it).
PLAIN_EPILOGUE = {"ADD_RES": False, "WEIGHTED": False, "SQUARES": False, "NB_PAD": 1}


def report_launches(shape: str) -> None:
    """The tensor-core GEMV as the engine launches each projection of a model shape at batch
    1 (int4 in groups of 128 with offsets, under PDL; gate_up with SiLU·up)."""
    for name, (n, k) in quant_kernel_bench.shapes(shape).items():
        silu = name == "gate_up"
        cfg = quant_gemv_mma.mma_gemv_config(n, k)
        programs = -(-n // cfg.rows) * cfg.splits
        const = {
            "GROUP": 128, "HAS_OFFSET": True, "HAS_BIAS": name == "qkv", "SILU_MUL": silu,
            "BN": cfg.rows, "BP": cfg.panels, "STAGES": cfg.num_stages, "SPLITS": cfg.splits,
            "ASM": True, "PDL": True,
            "EARLY": quant_gemv_mma.launches_early(programs, quant_gemv.SM_COUNT_FALLBACK),
            "AHEAD": quant_gemv_mma.first_step_ahead(True, silu), **PLAIN_EPILOGUE,
        }  # fmt: skip
        kernel = compile_sm90(quant_gemv_mma._mma_gemv_kernel, const, cfg.num_warps,
                              cfg.num_stages, cfg.max_registers)  # fmt: skip
        per_thread = cfg.rows * cfg.panels * 128 // (32 * cfg.num_warps)
        report(f"{shape} {name} ({n} x {k}) {cfg}", kernel, per_thread, 0, roles=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--top", type=int, default=8, help="opcodes to list")
    p.add_argument("--shape", help="also each projection of this model shape as launched")
    args = p.parse_args()
    top = args.top
    for group, offset in ((128, False), (32, True)):
        cfg = quant_gemv.gemv_config(3584, 3584, 4, 132)
        const = {
            "BITS": 4, "GROUP": group, "SLOTS": min(group // 16, 8), "HAS_OFFSET": offset,
            "HAS_BIAS": False, "SILU_MUL": False, "BN": cfg.rows, "BP": cfg.panels,
            "STAGES": cfg.num_stages,
        }  # fmt: skip
        k = compile_sm90(quant_gemv._qgemv_kernel, const, cfg.num_warps, cfg.num_stages)
        per_thread = cfg.rows * cfg.panels * 128 // (32 * cfg.num_warps)
        report(f"CUDA-core int4 g{group}{' + offsets' if offset else ''} {cfg}", k,
               per_thread, top)  # fmt: skip
    for rows in (16, 32, 64):
        for offset in (False, True):
            cfg = quant_gemv_mma.MmaGemvConfig(rows, 4)
            const = {
                "GROUP": 128, "HAS_OFFSET": offset, "HAS_BIAS": False, "SILU_MUL": False,
                "BN": rows, "BP": cfg.panels, "STAGES": cfg.num_stages, "SPLITS": 1,
                "ASM": True, "PDL": True, "EARLY": False, "AHEAD": True, **PLAIN_EPILOGUE,
            }  # fmt: skip
            k = compile_sm90(quant_gemv_mma._mma_gemv_kernel, const, cfg.num_warps, cfg.num_stages)
            per_thread = rows * cfg.panels * 128 // (32 * cfg.num_warps)
            report(f"tensor-core int4 g128{' + offsets' if offset else ''} {cfg}", k,
                   per_thread, top)  # fmt: skip
    if args.shape:
        report_launches(args.shape)


if __name__ == "__main__":
    main()
