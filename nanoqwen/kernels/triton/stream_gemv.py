"""Batch-1 products with large weights (7B's projections, 26-272 MB, and the lm_head), the
weight streamed by bulk copies.

At one token a projection reads its weight once, so its time is the weight's bytes over the
rate the kernel keeps them coming. gemv.py's loads go through the registers, and for weights
above GEMV_MAX_BYTES cuBLAS did better (7B: 3.69 TB/s over a step's projections, against the
H200's ~4.3 TB/s copy rate). Here each program's tiles of weight rows arrive as TMA copies
(one instruction a [rows, columns] tile), which Triton pipelines STAGES deep into shared
memory, so a program keeps several tiles in flight without holding them in registers. Short,
wide weights (qkv, o_proj and down_proj at 7B: 224-288 blocks of 16 rows) also split their
columns over programs (split_sums.py: the last program of a block adds the splits' sums), so
every SM has a few programs' copies in flight. 7B's batch-1 step against cuBLAS for the same
projections: 4.193 against 4.357 ms (H200, 2026-12-05).

As in gemv.py: the bias or SiLU·up in the epilogue, the add+RMSNorm in front in the prologue
(NORM: every program normalizes the row for itself), and launched as a programmatic dependent
at one row on sm_90, with the first tiles copied before the wait (StreamGemvConfig.ahead:
two against one took 7B's step 5.540 -> 5.381 ms, H100, 2026-12-05, one call, graph replay).
Or the residual add in the epilogue instead (residual=: x + residual stream and its blocks'
sums of squares) and the norm's 1 / RMS from those sums in the next launch (squares=), as
model/summed_row.py chains a layer (7B's step 4.989 -> 4.962 ms, H100, 2026-12-07).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from nanoqwen.kernels.triton.counters import zeroed_counters
from nanoqwen.kernels.triton.gemv_inputs import (
    gemv_input,
    input_from,
    raw_input,
    row_rstd,
    squares_rstd,
)
from nanoqwen.kernels.triton.pdl import use_pdl
from nanoqwen.kernels.triton.quant_gemv import sm_count
from nanoqwen.kernels.triton.split_sums import finish_split, row_bias, split_columns, split_span

TARGET_PROGRAMS = 512  # about four an SM of an H100/H200
SMEM_PER_SM = 227 << 10  # sm_90's shared memory a block may use


@dataclass(frozen=True)
class StreamGemvConfig:
    rows: int = 16  # weight rows a program (with SiLU·up: gate rows, and as many up rows)
    cols: int = 256  # columns a tile (a TMA box holds at most 256)
    splits: int = 1  # programs a block of rows' columns are divided among
    # three: 7B's step 5.377 -> 5.322 ms (H100, 2026-12-06), with every projection at three;
    # any one of them alone at three was no faster or slower
    num_stages: int = 3
    num_warps: int = 4
    # tiles copied before the wait for x under PDL (at most three: _stream_gemv_kernel holds
    # them in registers; three took 7B's projections to 80-168 registers and cost time)
    ahead: int = 2
    # A thread's registers at most (ptxas' maxnreg), or the compiler's choice.
    max_registers: int | None = None
    # Under PDL, 1: the kernel behind may launch at this one's start, 0: once its loops are
    # done; None: at its start where the grid fits in one wave (launches_early).
    early: int | None = None


def stream_gemv_config(n: int, k: int) -> StreamGemvConfig:
    """From the shape alone (CUDA graphs capture the launch): blocks of 16 rows, their
    columns split until about TARGET_PROGRAMS programs, each split whole tiles."""
    blocks = triton.cdiv(n, 16)
    splits = max(1, min(8, triton.cdiv(TARGET_PROGRAMS, blocks), triton.cdiv(k, 2 * 256)))
    return StreamGemvConfig(splits=splits)


@triton.jit
def _tile(w_desc, r0, N, k0, SILU_MUL: tl.constexpr):
    """The weight tile at columns k0 (and with SILU_MUL its up rows' tile)."""
    w = w_desc.load([r0, k0])
    u = w
    if SILU_MUL:
        u = w_desc.load([N + r0, k0])
    return w, u


@triton.jit
def _take(acc, acc_up, w, u, raw, sum_ptr, k0, K, rstd, first, NORM: tl.constexpr,
          SUM: tl.constexpr, SILU_MUL: tl.constexpr, BK: tl.constexpr,
          dtype: tl.constexpr):  # fmt: skip
    """acc (and acc_up) plus a tile copied ahead (w, u) times the input at columns k0,
    from its loads (raw_input's) issued ahead."""
    cols = k0 + tl.arange(0, BK)
    v, nw = raw
    x = input_from(v, nw, sum_ptr, cols, cols < K, rstd, first, NORM, SUM, dtype)
    acc += w.to(tl.float32) * x
    if SILU_MUL:
        acc_up += u.to(tl.float32) * x
    return acc, acc_up


@triton.jit
def _stream_gemv_kernel(
    x_ptr, w_desc, b_ptr, y_ptr, res_ptr, nw_ptr, sum_ptr, ids_ptr, part_ptr, counts_ptr,
    sq_ptr, N, K, chunk, NB, eps,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
    EMBED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr,
    STAGES: tl.constexpr, AHEAD: tl.constexpr, NORM_CHUNKS: tl.constexpr, PDL: tl.constexpr,
    NORM_WIDTH: tl.constexpr,
    EARLY: tl.constexpr, SQUARES: tl.constexpr, ADD_RES: tl.constexpr, NB_PAD: tl.constexpr,
):  # fmt: skip
    """y = W x (+ b) for rows BN*pid..; with SILU_MUL, W holds gate rows then N up rows and
    y = silu(W_gate x) * (W_up x). Program (pid, s) takes columns [s * chunk, (s + 1) *
    chunk), chunk a multiple of BK; with SPLITS > 1, part_ptr holds [SPLITS, rows] float32
    sums (rows: N, or 2N with SILU_MUL) and counts_ptr one zeroed int32 per block of rows.
    Columns past K arrive as zeros (TMA's bounds), and so do rows past the weight's; gate
    rows past N read up rows, never stored. With NORM, the first block's programs store x +
    residual over their columns, the whole row between them. With EMBED, x_ptr is the
    embedding table and x its row at the token id ids_ptr holds, stored like x + residual.
    With SQUARES (and NORM), x is already the residual stream and its sum of squares is in
    the NB partial sums at sq_ptr; with ADD_RES, y is finished as the residual stream
    (res_ptr's rows added) with its blocks' sums of squares to sq_ptr (split_sums.py)."""
    dtype: tl.constexpr = x_ptr.dtype.element_ty  # the input's rounding (y may be float32)
    if PDL:  # noqa: SIM102 (compile-time guards: Triton's `and` would not be)
        if EARLY:
            gdc_launch_dependents()
    block = tl.program_id(0)
    r0 = block * BN
    rows = r0 + tl.arange(0, BN)
    r_mask = rows < N
    k_begin, k_end = split_span(K, chunk, SPLITS)
    # Weights never change: the first AHEAD tiles are copied while the kernel in front
    # finishes, held in registers until x arrives.
    if AHEAD >= 1:
        w0, u0 = _tile(w_desc, r0, N, k_begin, SILU_MUL)
    if AHEAD >= 2:
        w1, u1 = _tile(w_desc, r0, N, k_begin + BK, SILU_MUL)
    if AHEAD >= 3:
        w2, u2 = _tile(w_desc, r0, N, k_begin + 2 * BK, SILU_MUL)
    bias = row_bias(b_ptr, rows, r_mask, HAS_BIAS)
    if PDL:
        gdc_wait()
    if EMBED:
        x_ptr += tl.load(ids_ptr).to(tl.int64) * K
    # The tiles copied ahead take their inputs' loads now, all at once.
    if AHEAD >= 1:
        c0 = k_begin + tl.arange(0, BK)
        raw0 = raw_input(x_ptr, res_ptr, nw_ptr, c0, c0 < K, NORM, HAS_RES)
    if AHEAD >= 2:
        c1 = k_begin + BK + tl.arange(0, BK)
        raw1 = raw_input(x_ptr, res_ptr, nw_ptr, c1, c1 < K, NORM, HAS_RES)
    if AHEAD >= 3:
        c2 = k_begin + 2 * BK + tl.arange(0, BK)
        raw2 = raw_input(x_ptr, res_ptr, nw_ptr, c2, c2 < K, NORM, HAS_RES)
    rstd = 0.0
    if SQUARES:
        rstd = squares_rstd(sq_ptr, NB, K, eps, NB_PAD)
    elif NORM:
        rstd = row_rstd(x_ptr, res_ptr, K, eps, HAS_RES, BK, NORM_CHUNKS, NORM_WIDTH)
    first = block == 0
    SUM: tl.constexpr = HAS_RES or EMBED
    acc = tl.zeros([BN, BK], tl.float32)
    acc_up = tl.zeros([BN, BK], tl.float32)
    start = k_begin
    if AHEAD >= 1:
        acc, acc_up = _take(acc, acc_up, w0, u0, raw0, sum_ptr, start, K, rstd, first, NORM,
                            SUM, SILU_MUL, BK, dtype)  # fmt: skip
        start += BK
    if AHEAD >= 2:
        acc, acc_up = _take(acc, acc_up, w1, u1, raw1, sum_ptr, start, K, rstd, first, NORM,
                            SUM, SILU_MUL, BK, dtype)  # fmt: skip
        start += BK
    if AHEAD >= 3:
        acc, acc_up = _take(acc, acc_up, w2, u2, raw2, sum_ptr, start, K, rstd, first, NORM,
                            SUM, SILU_MUL, BK, dtype)  # fmt: skip
        start += BK
    for k0 in tl.range(start, k_end, BK, num_stages=STAGES):
        cols = k0 + tl.arange(0, BK)
        x = gemv_input(x_ptr, res_ptr, nw_ptr, sum_ptr, cols, cols < K, rstd, first, NORM,
                       HAS_RES, SUM, dtype)  # fmt: skip
        acc += w_desc.load([r0, k0]).to(tl.float32) * x
        if SILU_MUL:
            acc_up += w_desc.load([N + r0, k0]).to(tl.float32) * x
    if PDL:  # noqa: SIM102 (compile-time guards)
        if not EARLY:
            gdc_launch_dependents()
    y = tl.sum(acc, 1)
    up = tl.sum(acc_up, 1)
    finish_split(part_ptr, counts_ptr, bias, y_ptr, block, tl.program_id(1), rows, r_mask, y,
                 up, N, res_ptr, sq_ptr, y_ptr, y_ptr, SPLITS, HAS_BIAS, SILU_MUL,
                 ADD_RES)  # fmt: skip


def one_wave(cfg: StreamGemvConfig, silu_mul: bool, itemsize: int, device) -> int:
    """Programs the GPU holds at once, as its shared memory limits them (the tiles in flight;
    registers allow more): a larger grid runs in waves (7B's gate_up, 1,184 programs)."""
    smem = cfg.num_stages * cfg.rows * cfg.cols * itemsize * (2 if silu_mul else 1)
    return min(8, SMEM_PER_SM // smem) * sm_count(device)


def launches_early(cfg: StreamGemvConfig, programs: int, silu_mul: bool, itemsize: int,
                   device) -> bool:  # fmt: skip
    """Whether the kernel behind may launch at this one's start: cfg.early, else where the
    grid fits in one wave (a larger one's later programs would find the SMs held by the
    programs waiting behind it)."""
    if cfg.early is not None:
        return bool(cfg.early)
    return programs <= one_wave(cfg, silu_mul, itemsize, device)


def norm_width(k: int) -> int:
    """Columns the add+RMSNorm's sum of squares loads at once (gemv_inputs.row_rstd), 0 for
    a chunk at a time: 7B's 3,584-wide rows in one wide load (its step 1.005x, H100,
    2026-12-06); 0.5B's 896 in four chunks, which the sm_90 SASS issues together already."""
    return triton.next_power_of_2(k) if k >= 2048 else 0


def tiles_ahead(cfg: StreamGemvConfig, pdl: bool, chunk: int) -> int:
    """Tiles a launch copies before the loop: where they can start before the wait for x
    (tests set it without the wait), and no more than a split's columns hold."""
    return min(cfg.ahead, chunk // cfg.cols) if pdl else 0


def stream_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu_mul: bool = False,
    norm: tuple | None = None,
    config: StreamGemvConfig | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    squares: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
):
    """x [1, K] times weight [N, K] (+ bias): [1, N] in out_dtype (x's by default; float32
    logits straight from the float32 sums), written into out when given (contiguous, of that
    shape and dtype); with silu_mul, weight = [W_gate; W_up] and the result silu(gate) * up,
    [1, N // 2]. norm: (residual or None, norm weight, eps) for the add+RMSNorm in front, and
    then (y, x + residual) is returned. ids (with norm): x is an embedding table and the
    input its row at ids[0]. squares (with norm, residual None): x is already the residual
    stream, the float32 partial sums of its squares are these. residual: the product is
    added to it as HF's residual add does and (x + residual stream, its squares) returned,
    the squares a float32 [1, blocks] tensor for a later launch's `squares`."""
    rows_w, k = weight.shape
    n = rows_w // 2 if silu_mul else rows_w
    cfg = config or stream_gemv_config(n, k)
    y = out if out is not None else torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    pdl = use_pdl(x)
    blocks = triton.cdiv(n, cfg.rows)
    chunk, splits = split_columns(k, cfg.cols, cfg.splits)
    part = counts = y  # unused with one split
    if splits > 1:
        part = torch.empty(splits, rows_w, dtype=torch.float32, device=x.device)
        counts = zeroed_counters(x.device, blocks, "stream gemv splits")
    x = x.contiguous()
    res, nw, eps = norm if norm is not None else (None, x, 0.0)
    if squares is not None and (norm is None or res is not None or ids is not None):
        raise ValueError("squares go with a norm over x alone (no residual, no ids)")
    if residual is not None and (norm is not None or silu_mul):
        raise ValueError("a residual add after the product takes no norm or SiLU·up")
    sq = squares
    if residual is not None:
        sq = torch.empty(1, blocks, dtype=torch.float32, device=x.device)
        res = residual.contiguous()
    has_res = norm is not None and res is not None
    stores = has_res or ids is not None
    total = x.new_empty(1, k) if stores else x
    desc = TensorDescriptor.from_tensor(weight, [cfg.rows, cfg.cols])
    _stream_gemv_kernel[(blocks, splits)](
        x, desc, x if bias is None else bias, y, x if res is None else res.contiguous(), nw,
        total, x if ids is None else ids, part, counts, x if sq is None else sq, n, k, chunk,
        0 if sq is None else sq.shape[-1], eps,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM=norm is not None,
        HAS_RES=has_res, EMBED=ids is not None, BN=cfg.rows, BK=cfg.cols,
        SPLITS=splits, STAGES=cfg.num_stages, AHEAD=tiles_ahead(cfg, pdl, chunk),
        NORM_CHUNKS=triton.cdiv(k, cfg.cols), PDL=pdl,
        NORM_WIDTH=norm_width(k),
        EARLY=launches_early(cfg, blocks * splits, silu_mul, weight.element_size(), x.device),
        SQUARES=squares is not None, ADD_RES=residual is not None,
        NB_PAD=triton.next_power_of_2(sq.shape[-1]) if sq is not None else 1,
        launch_pdl=pdl,
        num_warps=cfg.num_warps,
        **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}),
    )  # fmt: skip
    if residual is not None:
        return y, sq
    return y if norm is None else (y, total)
