"""Compiles Triton kernels for the H200 (sm_90) on a machine without a GPU: Triton's LLVM
and its bundled ptxas, no driver. Run as a script (tests/kernels/triton/test_sm90_compile.py
does, in a process without Triton's interpreter, which replaces @triton.jit); prints one JSON
line per case: its name and its compiled resource use, or its error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BF16, F32, I32, I64 = "*bf16", "*fp32", "*i32", "*i64"


def resources(cubin: bytes) -> dict[str, int]:
    """REG, SHARED, LOCAL (bytes a thread spills to local memory), ... from cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    line = next(x for x in out.splitlines() if "REG:" in x)
    return {
        k: int(v) for k, v in (p.split(":") for p in line.split() if p.split(":")[-1].isdigit())
    }


def compile_sm90(kernel, types: dict[str, str], constexprs: dict, warps: int, stages: int) -> dict:
    sig = {name: "constexpr" if name in constexprs else types[name] for name in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    options = {"num_warps": warps, "num_stages": stages}
    return resources(
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]
    )


def gemv_cases():
    """kernels/triton/gemv.py at the 0.5B shape's projections, each epilogue and prologue."""
    from nanoqwen.kernels.triton import gemv

    types = dict(x_ptr=BF16, w_ptr=BF16, b_ptr=BF16, y_ptr=BF16, res_ptr=BF16, nw_ptr=BF16,
                 sum_ptr=BF16, N="i32", K="i32", eps="fp32")  # fmt: skip
    for name, n, k, bias, silu, norm in (
        ("qkv", 1152, 896, True, False, True), ("o", 896, 896, False, False, False),
        ("gate_up", 9728, 896, False, True, True), ("down", 896, 4864, False, False, False),
    ):  # fmt: skip
        rows, cols = gemv._blocks(n, k)
        rows = max(1, rows // 2) if silu else rows
        for fused, res in {(False, False), (norm, False), (norm, norm)}:
            flags = dict(HAS_BIAS=bias, SILU_MUL=silu, NORM=fused, HAS_RES=res, BN=rows, BK=cols)
            label = f"gemv {name}" + (" +norm" if fused else "") + (" +residual" if res else "")
            yield label, gemv._gemv_kernel, types, flags, 4, 3


def sampler_cases():
    """The sampler's passes (kernels/triton/sample.py, sampling_thresholds.py) at Qwen2.5's
    vocabulary with the default tiles and candidates."""
    from nanoqwen.kernels.triton import sample
    from nanoqwen.kernels.triton import sampling_thresholds as st
    from nanoqwen.runtime.sampling.sampler import CANDIDATES as CAP

    vocab = 151936
    pow2 = triton.next_power_of_2(triton.cdiv(vocab, sample.TILE))
    state = dict(slots_ptr=I64, fparams_ptr=F32, iparams_ptr=I64, out_pos_ptr=I64)
    parts = dict(part_max_ptr=F32, part_sum_ptr=F32, part_arg_ptr=I32, part_gval_ptr=F32,
                 part_gidx_ptr=I32, num_tiles="i32", vocab="i32")  # fmt: skip
    prepare = dict(logits_ptr=F32, logits_stride="i32", z_ptr=F32, prompt_mask_ptr="*i1",
                   counts_ptr=I32, ban_mask_ptr="*i1", **state, **parts)  # fmt: skip
    flags = dict(WRITE_Z=True, SAMPLE=False, BLOCK=sample.TILE)
    yield "sampler prepare", sample._prepare_kernel, prepare, flags, 4, 3
    reduce = dict(m_ptr=F32, s_ptr=F32, greedy_ptr=I32, bound_ptr=F32, tokens_ptr=I64,
                  counts_ptr=I32, **state, **parts)  # fmt: skip
    flags = dict(FIRST=True, SAMPLED=True, RECORD=True, TILES=pow2, CANDIDATES=CAP)
    yield "sampler reduce", sample._reduce_kernel, reduce, flags, 1, 3
    finish = dict(z_ptr=F32, cand_ptr=F32, floor_ptr=F32, num_tiles="i32", need_ptr=I32,
                  tau_k_ptr=F32, tau_p_ptr=F32, tau_min_ptr=F32, m_ptr=F32, s_ptr=F32,
                  tau_ptr=F32, vocab="i32", **state)  # fmt: skip
    flags = dict(CAP=CAP, PROBES=st.PROBES, BLOCK=st.SEARCH_BLOCK, TILES=pow2)
    yield "sampler thresholds finish", st._finish_kernel, finish, flags, st.SEARCH_WARPS, 3


CASES = (gemv_cases, sampler_cases)


def main() -> None:
    for cases in CASES:
        for label, kernel, types, constexprs, warps, stages in cases():
            try:
                result = {"case": label, **compile_sm90(kernel, types, constexprs, warps, stages)}
            except Exception as e:  # reported, not raised: the test names the failing case
                result = {"case": label, "error": f"{type(e).__name__}: {e}"[:2000]}
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
