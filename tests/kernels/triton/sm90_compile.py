"""Compiles Triton kernels for the H200 (sm_90) on a machine without a GPU: Triton's LLVM
and its bundled ptxas, no driver. Run as a script (tests/kernels/triton/test_sm90_compile.py
does, in a process without Triton's interpreter, which replaces @triton.jit); prints one JSON
line per case: its name and its compiled resource use, or its error."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools import disasm

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


def compile_sm90(kernel, types: dict[str, str], constexprs: dict, warps: int, stages: int,
                 maxnreg: int | None = None) -> dict:  # fmt: skip
    """compile_kernel's resource use (cuobjdump's REG, STACK, ...), and for a kernel launched
    as a programmatic dependent its LOAD_WAITS."""
    cubin = compile_kernel(kernel, types, constexprs, warps, stages, maxnreg).asm["cubin"]
    found = resources(cubin)
    if constexprs.get("PDL"):
        found["LOAD_WAITS"] = load_waits(disasm.get_sass(cubin))
    return found


def load_waits(sass: str, most: int = 8) -> list[int]:
    """The global loads a thread issues after the wait for the kernel in front (ACQBULK),
    counted between instructions that wait on one of them: [28, 2, 24] is 28 loads in
    flight together, then 2 issued only once one of those arrived, then 24. Each group
    after the first is one more trip to memory on the way to the result. From each
    instruction's control code (wait mask : read barrier : write barrier : yield : stall);
    at most `most` groups."""
    after, pending, groups = False, 0, [0]
    for line in sass.splitlines():
        ctrl, _, asm = line.partition("\t")
        if "ACQBULK" in asm:
            after = True
        elif after and ctrl.count(":") == 4:
            wait, _, write, _, _ = ctrl.split(":")
            if wait != "--" and int(wait, 16) & pending:
                if len(groups) == most:
                    break
                groups.append(0)
                pending = 0
            if "LDG" in asm:
                groups[-1] += 1
                pending |= 0 if write == "-" else 1 << int(write)
    return groups if groups[-1] else groups[:-1]


def compile_kernel(kernel, types: dict[str, str], constexprs: dict, warps: int, stages: int,
                   maxnreg: int | None = None):  # fmt: skip
    """kernel compiled for sm_90. types: each argument's Triton type; "i32:16" marks an
    integer that is a multiple of 16 at run time. Those and every pointer carry the
    divisibility that Triton's launcher specializes on (every tensor the engine passes is
    16-byte aligned): without it, loads under masks that depend on a size do not vectorize,
    and register counts come out far above what the GPU compiles (0.5B's gate_up GEMV 190
    against 96)."""
    names = kernel.arg_names
    sig = {n: "constexpr" if n in constexprs else types[n].split(":")[0] for n in names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if n not in constexprs and (types[n].startswith("*") or types[n].endswith(":16"))
    }
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def gemv_cases():
    """kernels/triton/gemv.py at the 0.5B shape's projections, each epilogue and prologue."""
    from nanoqwen.kernels.triton import gemv

    types = dict(x_ptr=BF16, w_ptr=BF16, b_ptr=BF16, y_ptr=BF16, res_ptr=BF16, nw_ptr=BF16,
                 sum_ptr=BF16, ids_ptr=I64, N="i32:16", K="i32:16", eps="fp32")  # fmt: skip
    for name, n, k, bias, silu, norm in (
        ("qkv", 1152, 896, True, False, True), ("o", 896, 896, False, False, False),
        ("gate_up", 9728, 896, False, True, True), ("down", 896, 4864, False, False, False),
    ):  # fmt: skip
        rows, cols = gemv._blocks(n, k)
        rows = max(1, rows // 2) if silu else rows
        # the first layer's qkv reads its row from the embedding table (EMBED)
        inputs = {(False, False, False), (norm, False, False), (norm, norm, False)}
        inputs |= {(True, False, True)} if name == "qkv" else set()
        for (fused, res, embed), pdl in itertools.product(inputs, (False, True)):
            first = gemv._first_block(k, rows * (2 if silu else 1), cols, pdl)
            flags = dict(HAS_BIAS=bias, SILU_MUL=silu, NORM=fused, HAS_RES=res, EMBED=embed,
                         BN=rows, BK=cols, BK0=first, REST=first < k,
                         NORM_CHUNKS=triton.cdiv(k, cols), PDL=pdl)  # fmt: skip
            label = f"gemv {name}" + (" +norm" if fused else "") + (" +residual" if res else "")
            label += " +embed" if embed else ""
            label += " +pdl" if pdl else ""
            warps = gemv._warps(n, k)
            cap = gemv.register_cap(triton.cdiv(n // 2 if silu else n, rows), warps, 132)
            yield label, gemv._gemv_kernel, types, flags, warps, 3, cap


def stream_gemv_cases():
    """kernels/triton/stream_gemv.py at the 7B shape's projections and both shapes' lm_head
    with their launcher's configuration, as the decode step runs them (qkv, gate_up and the
    lm_head with the add+RMSNorm in front; float32 logits)."""
    from nanoqwen.kernels.triton import stream_gemv as sg

    for name, n, k, bias, silu, norm in (
        ("qkv", 4608, 3584, True, False, True), ("o", 3584, 3584, False, False, False),
        ("gate_up", 18944, 3584, False, True, True), ("down", 3584, 18944, False, False, False),
        ("lm_head", 152064, 3584, False, False, True), ("0.5B lm_head", 151936, 896, False,
                                                        False, True),
    ):  # fmt: skip
        cfg = sg.stream_gemv_config(n, k)
        y = F32 if name.endswith("lm_head") else BF16  # float32 logits
        types = dict(x_ptr=BF16, w_desc=f"tensordesc<bf16[{cfg.rows}, {cfg.cols}]>",
                     b_ptr=BF16, y_ptr=y, res_ptr=BF16, nw_ptr=BF16, sum_ptr=BF16, ids_ptr=I64,
                     part_ptr=F32, counts_ptr=I32, sq_ptr=F32, N="i32:16", K="i32:16",
                     chunk="i32:16", NB="i32", eps="fp32")  # fmt: skip
        chunk = sg.split_columns(k, cfg.cols, cfg.splits)[0]
        # the first layer's qkv; qkv and gate_up normalizing from sums of squares, o_proj and
        # down_proj adding the residual (model/summed_row.py)
        forms = ["plain"]
        forms += ["embed"] if name == "qkv" else []
        forms += ["squares"] if name in ("qkv", "gate_up") else []
        forms += ["add"] if name in ("o", "down") else []
        for pdl, form in itertools.product((False, True), forms):
            embed, squares = form == "embed", form == "squares"
            # gate_up's 1,184 programs and the lm_head's 9,500 run in waves: they let the
            # kernel behind launch late
            flags = dict(HAS_BIAS=bias, SILU_MUL=silu, NORM=norm,
                         HAS_RES=norm and not embed and not squares,
                         EMBED=embed, BN=cfg.rows,
                         BK=cfg.cols, SPLITS=cfg.splits, STAGES=cfg.num_stages,
                         AHEAD=sg.tiles_ahead(cfg, pdl, chunk),
                         NORM_CHUNKS=triton.cdiv(k, cfg.cols), PDL=pdl,
                         NORM_WIDTH=sg.norm_width(k),
                         EARLY=not silu and "lm_head" not in name, SQUARES=squares,
                         ADD_RES=form == "add",
                         NB_PAD=256 if form in ("squares", "add") else 1)  # fmt: skip
            label = "stream gemv " + ("" if name.startswith("0.5B") else "7B ") + name
            label += f" +{form}" if form != "plain" else ""
            label += " +pdl" if pdl else ""
            yield label, sg._stream_gemv_kernel, types, flags, cfg.num_warps, cfg.num_stages


def sampler_cases():
    """The sampler's passes (kernels/triton/sample.py, sampling_thresholds.py) at Qwen2.5's
    vocabulary with the default tiles and candidates."""
    from nanoqwen.kernels.triton import nucleus_draw as nd
    from nanoqwen.kernels.triton import row_search as rs
    from nanoqwen.kernels.triton import sample
    from nanoqwen.kernels.triton import sampling_thresholds as st
    from nanoqwen.runtime.sampling.sampler import CANDIDATES as CAP

    vocab = 151936
    pow2 = triton.next_power_of_2(triton.cdiv(vocab, sample.TILE))
    state = dict(slots_ptr=I64, fparams_ptr=F32, iparams_ptr=I64, out_pos_ptr=I64)
    parts = dict(part_max_ptr=F32, part_sum_ptr=F32, part_arg_ptr=I32, part_gval_ptr=F32,
                 part_gidx_ptr=I32, num_tiles="i32", vocab="i32")  # fmt: skip
    prepare = dict(logits_ptr=F32, logits_stride="i32", z_ptr=F32, prompt_mask_ptr="*i1",
                   counts_ptr=I32, maybe_seen_ptr=I32, ban_mask_ptr="*i1", m_ptr=F32,
                   s_ptr=F32, greedy_ptr=I32, bound_ptr=F32, tokens_ptr=I64, row_count_ptr=I32,
                   pending_ptr=I32, target_ptr=F32, **state, **parts)  # fmt: skip
    # A filtering step's (z, the candidates' bound), a plain step's (the draw, recorded) and
    # a top-p-alone step's (z and every draw, the top-p rows' left open).
    for label, write_z, cands, draw in (
        ("", True, CAP, sample.DRAW_UNCUT),
        (" plain", False, 0, sample.DRAW_ALL),
        (" nucleus", True, 0, sample.DRAW_NUCLEUS),
    ):
        every = draw in (sample.DRAW_ALL, sample.DRAW_NUCLEUS)
        # (as batch 1 launches it, a programmatic dependent)
        flags = dict(WRITE_Z=write_z, PLAIN_Z=draw != sample.DRAW_NUCLEUS, SAMPLE=draw,
                     DRAW_EVERY_ROW=every, BLOCK=sample.TILE, TILES=pow2,
                     CANDIDATES=cands, PDL=True)  # fmt: skip
        yield "sampler prepare" + label, sample._prepare_kernel, prepare, flags, 4, 3
    draw = dict(z_ptr=F32, tau_ptr=F32, greedy_ptr=I32, tokens_ptr=I64, counts_ptr=I32,
                maybe_seen_ptr=I32, pending_ptr=I32, row_count_ptr=I32, **state,
                **parts)  # fmt: skip
    flags = dict(BLOCK=sample.TILE, TILES=pow2)
    yield "sampler draw", sample._sample_kernel, draw, flags, 4, 3
    candidates = dict(z_ptr=F32, part_max_ptr=F32, bound_ptr=F32, cand_ptr=F32, floor_ptr=F32,
                      count_ptr=I32, slots_ptr=I64, iparams_ptr=I64, vocab="i32",
                      num_tiles="i32")  # fmt: skip
    flags = dict(CAP=CAP, BLOCK=sample.TILE, OPEN_P=True)
    yield "sampler candidates", st._candidates_kernel, candidates, flags, 4, 3
    merge = dict(cand_ptr=F32, floor_ptr=F32, count_ptr=I32, num_tiles="i32", packed_ptr=F32,
                 top_ptr=F32, z_ptr=F32, m_ptr=F32, s_ptr=F32, tau_ptr=F32, tau_k_ptr=F32,
                 vocab="i32", search_keys_ptr=I64, search_target_ptr=F32, pending_ptr=I32,
                 **state)  # fmt: skip
    block = triton.next_power_of_2(triton.cdiv(vocab, sample.TILE) * CAP)
    flags = dict(CAP=CAP, BLOCK=block, TILES=pow2, OPEN_P=True, COMPACT=st.COMPACT,
                 PROBES=st.PROBES, SEARCH=st.SEARCH_BLOCK)  # fmt: skip
    yield "sampler thresholds", st._thresholds_kernel, merge, flags, st.WARPS, 3
    search = dict(
        z_ptr=F32,
        vocab="i32",
        keys_ptr=I64,
        bound_ptr=F32,
        m_ptr=F32,
        target_ptr=F32,
        partial_ptr=F32,
        count_ptr=I32,
        tau_ptr=F32,
        parts="i32",
    )
    for label, (probes, _, block) in (("small", rs.SMALL), ("large", rs.LARGE)):
        flags = dict(SLICE=256, PROBES=probes, BLOCK=block, PARTS_BLOCK=64 if probes <= 64 else 8)
        yield f"sampler row search round {label}", rs._round_kernel, search, flags, 4, 3
    draw = dict(z_ptr=F32, vocab="i32", num_tiles="i32", rows="i32", part_max_ptr=F32,
                pending_in_ptr=I32, pending_out_ptr=I32, tokens_ptr=I64, bound_ptr=F32,
                tau_ptr=F32, m_ptr=F32, target_ptr=F32, counts_ptr=I32, maybe_seen_ptr=I32,
                mass_ptr=F32, gval_ptr=F32, gidx_ptr=I32, count_ptr=I32, logits_ptr=F32,
                logits_stride="i32", **state)  # fmt: skip
    # A NUCLEUS step's rounds (plain rows read from the logits) at batch 1 and 64.
    for final, rows in itertools.product((False, True), (1, 64)):
        programs = min(nd.PROGRAMS, rows * triton.cdiv(vocab, sample.TILE))
        flags = dict(FINAL=final, BLOCK=sample.TILE, ROWS=rows, TILES=pow2,
                     NUM_PROGRAMS=programs, PLAIN_FROM_LOGITS=True, PDL=True)  # fmt: skip
        label = f"sampler nucleus draw round final={final} rows={rows}"
        yield label, nd._round_kernel, draw, flags, 4, 3


# (heads, KV heads, head dim) of the 0.5B and 7B shapes; bfloat16 and float8 KV caches.
HEADS = {"0.5B": (14, 2, 64), "7B": (28, 4, 128)}
CACHES = {"bf16": BF16, "fp8": "*fp8e4nv"}


def attention_cases():
    """The attention kernels and their neighbours at the shapes and settings their
    launchers pick: decode (batch 1 with splits, large batch with long tiles), verify (k = 4),
    prefill and its splits' merge, RoPE with the K/V write, add+RMSNorm, SiLU·up."""
    from nanoqwen.kernels.triton import decode_attention as da
    from nanoqwen.kernels.triton import prefill_attention as pa
    from nanoqwen.kernels.triton import rms_norm, rope, silu_mul
    from nanoqwen.kernels.triton import verify_attention as va
    from nanoqwen.kernels.triton.split_merge import merge_chunk

    for (shape, (heads, kv_heads, dim)), (cache, cache_type) in itertools.product(
        HEADS.items(), CACHES.items()
    ):
        group = heads // kv_heads
        kv = dict(k_cache_ptr=cache_type, v_cache_ptr=cache_type, tables_ptr=I32)
        heads_flags = dict(NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=dim, PAGE=256)
        decode = dict(qkv_ptr=BF16, pos_ptr=I64, slot_ptr=I64, ctx_ptr=I32, order_ptr=I32,
                      cos_ptr=F32, sin_ptr=F32, out_ptr=BF16, part_out_ptr=F32,
                      part_lse_ptr=F32, counts_ptr=I32, qkv_stride="i32:16", table_stride="i32",
                      scale_log2="fp32", **kv)  # fmt: skip
        # Batch 1 (16 splits), 128 pairs (the large tile, 4 splits) and 512 (one split, in
        # launch order), with each batch's tile, warps and merge chunk.
        for batch, splits, ordered in ((1, 16, False), (128 // kv_heads, 4, True),
                                       (512 // kv_heads, 1, True)):  # fmt: skip
            tile, warps = da.tile_config(batch, kv_heads, dim, cache == "fp8", 256)
            pad = da.dot_rows(group)
            chunk = da.decode_merge_chunk(batch * kv_heads, pad, dim, warps, splits)
            flags = dict(GROUP=group, GROUP_PAD=pad, TILE_N=tile, NUM_SPLITS=splits,
                         SPLITS_PAD=splits, ORDERED=ordered, PDL=batch == 1, MERGE_CHUNK=chunk,
                         PRELOAD=batch * kv_heads < da.LARGE_BATCH and splits > 1,
                         **heads_flags)  # fmt: skip
            label = f"decode attention {shape} {cache} tile {tile} warps {warps} splits {splits}"
            desc = f"tensordesc<{cache_type[1:]}[{tile}, {dim}]>"
            decode.update(k_desc=desc, v_desc=desc)
            yield label, da._decode_kernel, decode, flags, warps, da.NUM_STAGES
        rows, warps = va.verify_tile(5 * group, dim)
        verify = dict(q_ptr=BF16, ctx_ptr=I32, out_ptr=BF16, part_out_ptr=F32, part_lse_ptr=F32,
                      counts_ptr=I32, q_stride="i32:16", table_stride="i32", scale_log2="fp32",
                      **kv)  # fmt: skip
        flags = dict(Q=5, GROUP=group, ROWS=rows, TILE_N=va.TILE, NUM_SPLITS=8, SPLITS_PAD=8,
                     MERGE_CHUNK=merge_chunk(rows, dim, warps, 8), **heads_flags)  # fmt: skip
        yield f"verify attention {shape} {cache}", va._verify_kernel, verify, flags, warps, 2
        block_m, block_n, warps, stages = pa.prefill_config(dim, 4096)
        prefill = dict(q_ptr=BF16, out_ptr=BF16, part_out_ptr=F32, part_lse_ptr=F32,
                       cu_q_ptr=I32, ctx_ptr=I32, q_stride="i32:16", table_stride="i32",
                       scale_log2="fp32", **kv)  # fmt: skip
        pad = da.dot_rows(group)
        for splits in (1, 4):
            flags = dict(GROUP=group, GROUP_PAD=pad, BLOCK_M=block_m, BLOCK_N=block_n,
                         NUM_SPLITS=splits, MIN_KEYS=pa.MIN_SPLIT_KEYS, **heads_flags)  # fmt: skip
            label = f"prefill attention {shape} {cache}" + (f" splits {splits}" * (splits > 1))
            yield label, pa._prefill_kernel, prefill, flags, warps, stages
        if cache == "bf16":
            merge = dict(part_out_ptr=F32, part_lse_ptr=F32, out_ptr=BF16, cu_q_ptr=I32,
                         ctx_ptr=I32)  # fmt: skip
            flags = dict(NUM_HEADS=heads, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n,
                         NUM_SPLITS=4, MIN_KEYS=pa.MIN_SPLIT_KEYS, ROWS=pa.MERGE_ROWS)  # fmt: skip
            yield f"prefill merge {shape}", pa._merge_kernel, merge, flags, 4, 1
        store = dict(qkv_ptr=BF16, qkv_stride="i32:16", pos_ptr=I64, cos_ptr=F32, sin_ptr=F32,
                     slot_ptr=I64, k_cache_ptr=cache_type, v_cache_ptr=cache_type)  # fmt: skip
        flags = dict(NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=dim)
        yield f"rope and store {shape} {cache}", rope._rope_store_kernel, store, flags, 1, 3
    norm = dict(x_ptr=BF16, res_ptr=BF16, w_ptr=BF16, out_ptr=BF16, n_cols="i32",
                x_stride="i32", res_stride="i32", out_stride="i32", eps="fp32")  # fmt: skip
    for cols, residual, pdl in itertools.product((896, 3584), (False, True), (False, True)):
        flags = dict(HAS_RESIDUAL=residual, BLOCK=triton.next_power_of_2(cols), PDL=pdl)
        warps = 4 if cols <= 2048 else 8
        label = f"rms_norm {cols}" + (" +residual" if residual else "") + (" +pdl" if pdl else "")
        yield label, rms_norm._rms_norm_kernel, norm, flags, warps, 3
    mlp = dict(gu_ptr=BF16, out_ptr=BF16, n_cols="i32", gu_stride="i32", out_stride="i32")
    for pdl in (False, True):
        label = "silu_mul" + (" +pdl" if pdl else "")
        yield label, silu_mul._silu_mul_kernel, mlp, dict(BLOCK=1024, PDL=pdl), 4, 3


def quant_cases():
    """The int4 tensor-core GEMV (kernels/triton/quant_gemv_mma.py) at the 7B shape's
    projections, groups of 128 with offsets, with its launcher's configuration and with the
    panels split over 2 and 4 programs."""
    from nanoqwen.kernels.triton import quant_gemv_mma as q

    # N, K and KW (K / 8) are multiples of 16 at every Qwen2.5 shape, and the launcher
    # specializes on that (the packed words' loads vectorize); G (K / 128) is not.
    types = dict(x_ptr=BF16, qw_ptr=I32, s_ptr=BF16, o_ptr=BF16, b_ptr=BF16, y_ptr=BF16,
                 part_ptr=F32, counts_ptr=I32, res_ptr=BF16, nw_ptr=BF16, xw_ptr=BF16,
                 sq_ptr=F32, sq_in_ptr=F32, N="i32:16", K="i32:16", KW="i32:16", G="i32",
                 chunk="i32", NB="i32", eps="fp32")  # fmt: skip
    for name, n, k, bias, silu in (
        ("qkv", 4608, 3584, True, False), ("o", 3584, 3584, False, False),
        ("gate_up", 37888, 3584, False, True), ("down", 3584, 18944, False, False),
    ):  # fmt: skip
        cfg = q.mma_gemv_config(n, k)
        for splits in sorted({cfg.splits, 2, 4}):
            # As launched at one row on sm_90 (quant_gemv_mma.launch_mma_gemv).
            early = q.launches_early(triton.cdiv(n, cfg.rows) * splits, 132)
            flags = dict(GROUP=128, HAS_OFFSET=True, HAS_BIAS=bias, SILU_MUL=silu, BN=cfg.rows,
                         BP=cfg.panels, STAGES=cfg.num_stages, SPLITS=splits, ASM=True,
                         PDL=True, EARLY=early, AHEAD=not silu, ADD_RES=False, WEIGHTED=False,
                         SQUARES=False, NB_PAD=1)  # fmt: skip
            label = f"int4 gemv 7B {name}" + (f" splits {splits}" if splits != cfg.splits else "")
            yield label, q._mma_gemv_kernel, types, flags, cfg.num_warps, 3
        # As the layer runs at one row (model/summed_row.py): o_proj and down_proj add the
        # residual and weigh it, qkv and gate_up scale by the squares' 1 / RMS.
        if name in ("o", "down"):
            summed = dict(ADD_RES=True, WEIGHTED=True)
            label = f"int4 gemv 7B {name} +residual"
        else:
            summed = dict(SQUARES=True, NB_PAD=256)
            label = f"int4 gemv 7B {name} +squares"
        yield label, q._mma_gemv_kernel, types, {**flags, **summed}, cfg.num_warps, 3


CASES = (gemv_cases, stream_gemv_cases, sampler_cases, attention_cases, quant_cases)


def main() -> None:
    for cases in CASES:
        for label, kernel, types, constexprs, warps, stages, *maxnreg in cases():
            try:
                res = compile_sm90(kernel, types, constexprs, warps, stages, *maxnreg)
                result = {"case": label, **res}
            except Exception as e:  # reported, not raised: the test names the failing case
                result = {"case": label, "error": f"{type(e).__name__}: {e}"[:2000]}
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
