"""Batch-1 int4 GEMV on the tensor cores, for groups of 128 columns or more.

The CUDA-core GEMV (kernels/triton/quant_gemv.py) spends ~5.2 instructions a weight (a LOP3 and an
FADD to turn a value into a float, an FFMA to multiply it, and overhead), so at int4 the H200
runs out of instruction issue long before HBM bandwidth. Here the multiply-adds go to the
tensor cores, which have plenty to spare at one token: a program dequantizes a [rows, 128]
tile of one panel (one group of 128 columns) to x's dtype and lets tl.dot multiply it with
x broadcast to 16 columns (mma's smallest N; the duplicate columns cost nothing, as the
compiler keeps one copy of identical mma instructions).

Dequantizing is the "magic number" conversion of Marlin-class kernels, two values per
instruction: a word's nibbles j and j + 4 sit in its low and high 16-bit halves, so one LOP3
makes (0x4300 | q_j, 0x4300 | q_j+4) = (128 + q_j, 128 + q_j+4) in bf16 (0x6400, 1024 in
fp16). The 128 stays in: the dots sum (128 + q) x, and each group's sum gives back 128 times
the panel's x sum along with its offset (scale * code + offset = scale * (128 + code) +
(offset - 128 * scale)), once a group and row instead of a packed FMA every two weights. With
three shifts that is 7 instructions for a word's 8 values (inline PTX; Triton's interpreter
runs a plain shift-and-mask version that adds the same 128). 128 + q is exact in bf16 and
1024 + q in fp16, products of two 16-bit floats are exact in float32 and the tensor cores
accumulate in float32, so a group's sum is off by about 2^-17 of its sum of |x| (2^-14 in
fp16), far below the output's rounding.
The K order inside a panel is the unpacking order, not the column order, and x (one
contiguous load a panel) is permuted in registers to match: a word's values go to two dots
of 64 (`low` and `high`), four consecutive K positions each, which is the tensor-core
operand's own register layout (kWidth 4), so the packed words go from shared memory straight
to registers in that layout and nothing is staged in bf16. The panel's x sum comes from a
second dot (with ones), straight in the accumulator's layout. Compiled for sm_90, a weight
costs ~3.7 instructions at 16 rows x 4 panels a step, ~2.5 at 32 and ~2.0 at 64 (groups of
128 with offsets; tools/quant_gemv_sass.py). A program handles
`rows` weight rows and `panels` panels a step (a batch dimension, one per warp), summed over
the batch at the end. For gate_up (SiLU·up fused) half of a program's rows are gate rows and
half their up rows, so both stream in one loop: against a loop over the gate rows and then
one over the up rows, with the same 32 rows a step, 7B int4's step 2.348 -> 2.261 ms and
0.5B's 0.645 -> 0.611 (H100, 2026-12-06, two runs each).

`splits` > 1 divides a block of rows' panels among that many programs, for short, wide
weights (7B's qkv, o_proj and down_proj: 224-288 programs of 16 rows). Each stores its
float32 sums and counts itself in with an atomic add; the last of a block to arrive adds the
splits' sums in split order (the same result whatever the arrival order), then the bias and
SiLU·up, so no kernel of its own reduces them. The default is one split: those three split
to about 512 programs made 7B int4's step 2.500 ms against 2.455 (H200, 2026-12-05).

At one row on sm_90 it launches as a programmatic dependent (pdl.py): its launch overlaps
the kernel in front, and the kernel behind launches early too (EARLY_PROGRAMS_PER_SM).
7B int4's step against launching normally: 2.603 -> 2.455 ms (H100, 2026-12-05). The first
step's weights then load before the wait for x (first_step_ahead). All of it, the codes
unpacked as 128 + code (_code_bias) and 7B's gate_up capped at 128 registers against the
tree before: 2.629 -> 2.354 ms (H100, 2026-12-05, one call, two runs each; 2.413 without
the last two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoqwen.kernels.triton.counters import zeroed_counters
from nanoqwen.kernels.triton.gemv_inputs import parts_rstd, square_parts
from nanoqwen.kernels.triton.pdl import use_pdl
from nanoqwen.kernels.triton.quant_gemv import PANEL, kernel_group, sm_count
from nanoqwen.kernels.triton.split_sums import finish_split, row_bias, split_columns, split_span

MMA_PANEL_COLS = PANEL * 8  # int4 columns of a panel: the smallest group this kernel takes
# Under PDL a grid of at most this many programs an SM (7B's qkv, 288, o_proj and down_proj,
# 224) lets the kernel behind launch at its start, so that the decode kernel's launch hides
# behind qkv (7B int4's step 2.253 -> 2.236 ms against two an SM, H100); a larger one
# (gate_up, 1,184) only once its loops are done, so that the programs waiting behind it do
# not hold the SMs its later programs need (letting every grid's dependents launch at its
# start made the step 52% slower: pdl.py).
EARLY_PROGRAMS_PER_SM = 3


def launches_early(programs: int, sms: int) -> bool:
    """Whether a grid of this many programs lets the kernel behind it launch at its start."""
    return programs <= EARLY_PROGRAMS_PER_SM * sms


# Outputs $0..$7 are value slots 0..7 of the word in $8, each code plus the magic float
# (_code_bias). (a & b) | c is LOP3 immediate 0xea.
_UNPACK_PTX = """{{
.reg .b32 t<4>, s<3>;
lop3.b32 t0, $8, 0x000F000F, {magic}, 0xea;
shr.u32 s0, $8, 4;
lop3.b32 t1, s0, 0x000F000F, {magic}, 0xea;
shr.u32 s1, $8, 8;
lop3.b32 t2, s1, 0x000F000F, {magic}, 0xea;
shr.u32 s2, $8, 12;
lop3.b32 t3, s2, 0x000F000F, {magic}, 0xea;
mov.b32 {{$0, $4}}, t0;
mov.b32 {{$1, $5}}, t1;
mov.b32 {{$2, $6}}, t2;
mov.b32 {{$3, $7}}, t3;
}}"""
# magic: two of the float whose mantissa a code is OR-ed into (its ulp is 1).
UNPACK_BF16 = tl.constexpr(_UNPACK_PTX.format(magic="0x43004300"))
UNPACK_F16 = tl.constexpr(_UNPACK_PTX.format(magic="0x64006400"))


@dataclass(frozen=True)
class MmaGemvConfig:
    # weight rows per program (>= 16, mma's M); with SiLU·up half of them gate rows, half
    # their up rows
    rows: int
    panels: int  # panels per loop step, the batch dimension of the dot
    num_warps: int = 4
    num_stages: int = 3
    splits: int = 1  # programs a block of rows' panels are divided among
    # A thread's registers at most (ptxas' maxnreg), or the compiler's choice: at 128, four
    # programs of four warps fit an SM's 64K registers.
    max_registers: int | None = None


@triton.jit
def _code_bias(dtype: tl.constexpr):
    """What an unpacked code carries on top of its value: the magic float (128 in bfloat16,
    1024 in float16, where the code fills the last bits of its mantissa; 128 for the
    interpreter's float32)."""
    bias = 128.0
    if dtype == tl.float16:
        bias = 1024.0
    return bias


@triton.jit
def _unpack(words, dtype: tl.constexpr, ASM: tl.constexpr):
    """int32 words [...] -> their 8 int4 codes plus _code_bias(dtype) in dtype as two
    [..., 4] halves, `low` (value slots 0, 4, 1, 5) and `high` (2, 6, 3, 7)."""
    if ASM:
        if dtype == tl.bfloat16:
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                UNPACK_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1,
            )  # fmt: skip
        else:
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                UNPACK_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words],
                dtype=(tl.float16,) * 8, is_pure=True, pack=1,
            )  # fmt: skip
    else:
        bias = _code_bias(dtype)
        v0 = ((words & 15).to(tl.float32) + bias).to(dtype)
        v1 = (((words >> 4) & 15).to(tl.float32) + bias).to(dtype)
        v2 = (((words >> 8) & 15).to(tl.float32) + bias).to(dtype)
        v3 = (((words >> 12) & 15).to(tl.float32) + bias).to(dtype)
        v4 = (((words >> 16) & 15).to(tl.float32) + bias).to(dtype)
        v5 = (((words >> 20) & 15).to(tl.float32) + bias).to(dtype)
        v6 = (((words >> 24) & 15).to(tl.float32) + bias).to(dtype)
        v7 = (((words >> 28) & 15).to(tl.float32) + bias).to(dtype)
    # The last join pairs slot j with j + 4, the two halves of one PTX register; four values
    # a thread in K is what the dot's operand layout holds (kWidth 4), so Triton converts
    # the packed words to it (in shared memory, 4 bytes for 8 values) and no bf16 moves.
    low = tl.join(tl.join(v0, v1), tl.join(v4, v5))
    high = tl.join(tl.join(v2, v3), tl.join(v6, v7))
    return low, high


@triton.jit
def _dot(w, x, acc):
    """w [BP, BN, K] times x [BP, K] broadcast to mma's 16 columns: [BP, BN, 16] float32."""
    xb = tl.broadcast_to(x[:, :, None], [x.shape[0], x.shape[1], 16])
    if x.dtype == tl.float32:  # the interpreter's exact mode
        return tl.dot(w, xb, acc, input_precision="ieee")
    return tl.dot(w, xb, acc)


@triton.jit
def _step_words(qw_ptr, rows64, KW, p0, BP: tl.constexpr):
    """The packed words of rows64 in the loop step's panels [p0, p0 + BP): [BP, BN, 16]. The
    last step's panels past the end read the last panel again (their x is zeroed), so no
    load needs a mask (a split's range is whole steps but for the last split's)."""
    P: tl.constexpr = 16  # PANEL
    pc = tl.minimum(p0 + tl.arange(0, BP), KW // P - 1)
    lane = tl.arange(0, P)
    return tl.load(
        qw_ptr + rows64[None, :, None] * KW + (pc[:, None] * P + lane[None, :])[:, None, :]
    )


@triton.jit
def _step(
    acc, words, x_ptr, s_ptr, o_ptr, rows64, K, KW, G, p0, p_end,
    GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    """acc plus one loop step's products: the words of panels [p0, p0 + BP) times x."""
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    P: tl.constexpr = 16  # PANEL
    panel = p0 + tl.arange(0, BP)
    p_ok = panel < p_end
    pc = tl.minimum(panel, KW // P - 1)
    low, high = _unpack(words, dtype, ASM)
    # The panel's x in one contiguous (cp.async) load, permuted in registers to the dots'
    # K order: column (4c + 2h + b) * 16 + i is position i * 4 + 2b + c of half h.
    cols = pc[:, None] * (8 * P) + tl.arange(0, 8 * P)[None, :]
    x = tl.load(x_ptr + cols, mask=p_ok[:, None] & (cols < K), other=0.0)
    x5 = tl.permute(tl.reshape(x, [BP, 2, 2, 2, P]), (0, 4, 3, 1, 2))
    x_low, x_high = tl.split(tl.reshape(x5, [BP, 4 * P, 2]))
    part = _dot(tl.reshape(low, [BP, BN, 4 * P]), x_low, None)
    part = _dot(tl.reshape(high, [BP, BN, 4 * P]), x_high, part)
    # The codes carry _code_bias: each group's sum takes bias times the panel's x sum back
    # out with its offset, weight = scale * code + offset. The x sum comes from the tensor
    # cores too (a dot with ones), in acc's own layout, with no reduction across threads;
    # the ones are built by joins like the weights, so Triton gives both dots one x layout.
    one = tl.full([BP, BN, P], 1.0, dtype)
    ones = tl.reshape(tl.join(tl.join(one, one), tl.join(one, one)), [BP, BN, 4 * P])
    x_sum = _dot(ones, x_high, _dot(ones, x_low, None))
    g_off = rows64[None, :] * G + (pc * (8 * P) // GROUP)[:, None]
    scale = tl.load(s_ptr + g_off).to(tl.float32)
    offset = -_code_bias(dtype) * scale
    if HAS_OFFSET:
        offset += tl.load(o_ptr + g_off).to(tl.float32)
    acc += part * scale[:, :, None] + x_sum * offset[:, :, None]
    return acc


@triton.jit
def _row_dot(
    x_ptr, qw_ptr, s_ptr, o_ptr, rows, K, KW, G, p_begin, p_end, first_words,
    GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
    STAGES: tl.constexpr, ASM: tl.constexpr, AHEAD: tl.constexpr,
):  # fmt: skip
    """float32 dot products of x with the dequantized weight rows `rows` (in bounds) over
    panels [p_begin, p_end): [BN]. AHEAD: first_words holds the first step's words, loaded
    by the caller (before its wait for x)."""
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BP, BN, 16], tl.float32)
    start = p_begin
    if AHEAD:
        acc = _step(acc, first_words, x_ptr, s_ptr, o_ptr, rows64, K, KW, G, p_begin, p_end,
                    GROUP, HAS_OFFSET, BN, BP, ASM)  # fmt: skip
        start += BP
    for p0 in tl.range(start, p_end, BP, num_stages=STAGES):
        words = _step_words(qw_ptr, rows64, KW, p0, BP)
        acc = _step(acc, words, x_ptr, s_ptr, o_ptr, rows64, K, KW, G, p0, p_end, GROUP,
                    HAS_OFFSET, BN, BP, ASM)  # fmt: skip
    # Every column of the product is the same sum: take column 0 (no rounding) of each step.
    first = tl.arange(0, 16)[None, None, :] == 0
    return tl.sum(tl.sum(tl.where(first, acc, 0.0), 2), 0)


@triton.jit
def _mma_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, o_ptr, b_ptr, y_ptr, part_ptr, counts_ptr, res_ptr, nw_ptr, xw_ptr,
    sq_ptr, sq_in_ptr, N, K, KW, G, chunk, NB, eps,
    GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr, STAGES: tl.constexpr,
    SPLITS: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
    AHEAD: tl.constexpr, ADD_RES: tl.constexpr = False, WEIGHTED: tl.constexpr = False,
    SQUARES: tl.constexpr = False, NB_PAD: tl.constexpr = 1,
):  # fmt: skip
    """y = W x (+ b) for BN weight rows a program; with SILU_MUL, W holds gate rows then N
    up rows, a program takes BN / 2 of each (one pass over both) and y = silu(W_gate x) *
    (W_up x). With SPLITS > 1, program (pid, s) takes panels [s * chunk, (s + 1) * chunk);
    part_ptr holds [SPLITS, rows] float32 sums (rows: N, or 2N with SILU_MUL) and
    counts_ptr one zeroed int32 per block of rows. With PDL it waits for x before its first
    load, and lets the kernel behind launch at its start (EARLY) or once its loops are
    done. ADD_RES (and WEIGHTED): y finishes as the residual stream, as split_sums.py's
    finish_rows does. SQUARES: x is a norm's output but for its 1 / RMS, which multiplies
    the sums, from the NB partial sums of squares at sq_in_ptr."""
    if PDL:  # noqa: SIM102 (compile-time guards: Triton's `and` would not be)
        if EARLY:
            gdc_launch_dependents()
    block = tl.program_id(0)
    OUT: tl.constexpr = BN // 2 if SILU_MUL else BN  # output rows a program
    rows = block * OUT + tl.arange(0, OUT)
    r_mask = rows < N
    # Rows past N recompute row N - 1, never stored; with SILU_MUL the first half of the
    # block's weight rows are gate rows, the second half their up rows.
    r = tl.arange(0, BN)
    w_rows = tl.minimum(block * OUT + r % OUT, N - 1) + (r // OUT) * N
    p_begin, p_end = split_span(KW // 16, chunk, SPLITS)
    # Weights never change: the first step's words are loaded while the kernel in front
    # finishes.
    first = tl.zeros([BP, BN, 16], tl.int32)
    if AHEAD:
        first = _step_words(qw_ptr, w_rows.to(tl.int64), KW, p_begin, BP)
    bias = row_bias(b_ptr, rows, r_mask, HAS_BIAS)
    if PDL:
        gdc_wait()  # x is the kernel in front's output
    if SQUARES:
        # summed only after the loop, so that no step waits for these loads
        parts = square_parts(sq_in_ptr, NB, NB_PAD)
    y = _row_dot(
        x_ptr, qw_ptr, s_ptr, o_ptr, w_rows, K, KW, G, p_begin, p_end, first, GROUP,
        HAS_OFFSET, BN, BP, STAGES, ASM, AHEAD,
    )  # fmt: skip
    if SQUARES:
        y = y * parts_rstd(parts, K, eps)  # the splits' sums alike, before they add up
    up = y
    if SILU_MUL:
        y, up = tl.split(tl.permute(tl.reshape(y, [2, OUT]), (1, 0)))
    if PDL:  # noqa: SIM102 (compile-time guards)
        if not EARLY:
            gdc_launch_dependents()
    finish_split(part_ptr, counts_ptr, bias, y_ptr, block, tl.program_id(1), rows, r_mask, y,
                 up, N, res_ptr, sq_ptr, nw_ptr, xw_ptr, SPLITS, HAS_BIAS, SILU_MUL, ADD_RES,
                 WEIGHTED)  # fmt: skip


def mma_gemv_fits(x: torch.Tensor, w) -> bool:
    """int4 in groups of whole panels, 16-bit activations on a GPU (or the interpreter)."""
    return mma_fits(w, x.dtype, x.device)


def mma_fits(w, dtype: torch.dtype, device: torch.device) -> bool:
    """mma_gemv_fits for activations of this dtype on this device."""
    if w.bits != 4 or kernel_group(w) % MMA_PANEL_COLS:
        return False
    return device.type == "cpu" or dtype in (torch.bfloat16, torch.float16)


def mma_gemv_config(n: int, k: int) -> MmaGemvConfig:
    """Launch parameters from the shape alone (so CUDA graphs can capture the kernel)."""
    # From tools/quant_kernel_bench.py's sweep on the H200 (Qwen2.5 0.5B and 7B shapes):
    # 16 rows keep >= 1.7 programs an SM below 16K rows, where more rows a step pay; long
    # rows (K >= N) like a fourth stage in flight, and rows four times as long as the
    # weight is tall (down_proj) 8 panels a step: 7B's step 2.603 -> 2.518 ms (H100).
    rows = 64 if n >= 65536 else 32 if n >= 16384 else 16
    panels = 8 if k >= 4 * n else 4
    # Tall weights (7B's gate_up: 1,184 programs of 16 gate and 16 up rows) have more
    # programs than an SM holds. Capped at 128 registers, 7B int4's step took 2.262-2.266 ms
    # against 2.289-2.294 for the compiler's own choice (H100, 2026-12-06, one call).
    cap = 128 if rows == 32 else None
    return MmaGemvConfig(rows, panels, num_stages=4 if k >= n else 3, max_registers=cap)


def first_step_ahead(pdl: bool, silu_mul: bool) -> bool:
    """Whether a launch loads its first step's weights before the loop: where it can start
    before the wait for x (tests set it without the wait). Not for gate_up, where 7B int4's
    step took 2.276-2.281 ms with it against 2.261 without (H100, 2026-12-06)."""
    return pdl and not silu_mul


def launch_mma_gemv(
    x: torch.Tensor,
    w,
    bias: torch.Tensor | None,
    silu_mul: bool,
    config: MmaGemvConfig | None,
    residual: torch.Tensor | None = None,
    norm_after: torch.Tensor | None = None,
    squares: torch.Tensor | None = None,
    eps: float = 0.0,
):
    """x [1, K] times the packed int4 weight: [1, N], or [1, N // 2] with silu_mul.
    residual: the product added to it as HF's residual add does, and (stream, float32
    partial sums of its squares [1, blocks], stream * norm_after rounded or None) returned.
    squares (another launch's): x is RMSNorm's output but for its 1 / RMS, which comes from
    these, with eps."""
    if residual is not None and silu_mul:
        raise ValueError("a residual add after the product takes no SiLU·up")
    if norm_after is not None and residual is None:
        raise ValueError("norm_after goes with a residual add")
    n = w.out_features // 2 if silu_mul else w.out_features
    cfg = config or mma_gemv_config(w.out_features, w.in_features)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(w.out_features, cfg.rows)  # rows: weight rows a program
    sq = xw = None
    if residual is not None:
        sq = torch.empty(1, blocks, dtype=torch.float32, device=x.device)
        xw = torch.empty_like(y) if norm_after is not None else None
    chunk, splits = split_columns(w.qweight.shape[1] // PANEL, cfg.panels, cfg.splits)
    part = counts = y  # unused with one split
    if splits > 1:
        part = torch.empty(splits, w.out_features, dtype=torch.float32, device=x.device)
        counts = zeroed_counters(x.device, blocks, "int4 gemv splits")
    pdl = use_pdl(x)
    early = pdl and launches_early(blocks * splits, sm_count(x.device))
    ahead = first_step_ahead(pdl, silu_mul)
    _mma_gemv_kernel[(blocks, splits)](
        x.contiguous(), w.qweight, w.scales, w.scales if w.offsets is None else w.offsets,
        w.scales if bias is None else bias, y, part, counts,
        y if residual is None else residual.contiguous(),
        y if norm_after is None else norm_after, y if xw is None else xw,
        y if sq is None else sq, y if squares is None else squares, n, w.in_features,
        w.qweight.shape[1], w.scales.shape[1], chunk,
        0 if squares is None else squares.shape[-1], eps, GROUP=kernel_group(w),
        HAS_OFFSET=w.offsets is not None, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        BN=cfg.rows, BP=cfg.panels, STAGES=cfg.num_stages, SPLITS=splits,
        ASM=x.device.type == "cuda", PDL=pdl, EARLY=early, AHEAD=ahead,
        ADD_RES=residual is not None, WEIGHTED=xw is not None, SQUARES=squares is not None,
        NB_PAD=triton.next_power_of_2(squares.shape[-1]) if squares is not None else 1,
        launch_pdl=pdl, num_warps=cfg.num_warps,
        **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}),
    )  # fmt: skip
    if residual is not None:
        return y, sq, xw
    return y
