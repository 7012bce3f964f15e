"""Weight-only quantized matrix-vector product for batch-1 decode.

At one token a projection is a pure weight stream, so the kernel reads each packed int32 word
once (a program holds `rows` output rows and walks K `panels` panels at a time, the next
steps' loads in flight through cp.async) and spends as few instructions per weight as it can,
since at int4 the H200 delivers ~10 G weights per ms:
- the packed layout (kernels/triton/quant_matmul.py) puts value j of a panel's 16 words on 16
  consecutive columns, so x for value j of every word is one contiguous vector load;
- a value becomes a float by OR-ing it into the mantissa of 2^23 and subtracting 2^23 (exact,
  and full-rate ALU work where an int-to-float conversion is quarter rate), masked where it
  lies in its 16-bit half of the word (no shift), x for that slot pre-scaled to match;
- a group's products are summed before its scale multiplies them once a word, and its offset
  enters as offset * sum(x): sum_k x_k (q_k s + o) = s sum_k x_k q_k + o sum_k x_k;
- tiles are [panels, rows, lanes] so a thread holds several rows of the same columns and
  converts each x value once for all of them.
Compiled for sm_90 (Triton 3.6, read from the SASS), the loop issues ~5.4 instructions a
weight at int4 groups of 128 and ~7.2 at groups of 32 with offsets. The H200 issues ~33 T
thread-instructions a second, so int4 tops out near 4.6-6 G weights a ms where full HBM
bandwidth would feed ~10 G: at int4 the kernel is bound by instruction issue, not memory.
int4 in groups of 128 or more therefore takes the tensor-core GEMV
(kernels/triton/quant_gemv_mma.py) instead; this kernel serves int8, smaller groups (GGUF's
Q4_K) and float32 activations.
Accumulation is in float32; the result rounds once to x's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanoqwen.kernels.triton.silu_mul import _silu_mul

SM_COUNT_FALLBACK = 132  # the H200's, for the CPU interpreter
MAGIC_2_23 = 0x4B000000  # float32 bits of 2^23, passed as an argument (see _slot_values)
PANEL = 16  # int32 words per panel: a group (>= 16 values) spans whole value slots of one


@dataclass(frozen=True)
class GemvConfig:
    rows: int  # output rows per program
    panels: int  # panels of each row per loop step (a power of two)
    num_warps: int = 4
    num_stages: int = 3  # loop steps in flight, counting the one computing


@triton.jit
def _slot_values(words, high, magic, j: tl.constexpr, BITS: tl.constexpr):
    """Value slot j of packed words as float32, times 2^(BITS * (j % HALF)) where HALF slots
    fill 16 bits, less the storage bias. The slot is masked in place (`high` = words >> 16
    serves the upper half) into the mantissa of 2^23 and 2^23 subtracted: one LOP3 and one
    FADD a value, since `magic` (the bits of 2^23) is a runtime value, not a second
    immediate."""
    HALF: tl.constexpr = 16 // BITS
    MASK: tl.constexpr = ((1 << BITS) - 1) << (j % HALF * BITS)
    ZERO: tl.constexpr = 8388608.0 + (128.0 * (1 << (j % HALF * BITS)) if BITS == 8 else 0.0)
    q = ((words if j < HALF else high) & MASK) | magic
    return q.to(tl.float32, bitcast=True) - ZERO


@triton.jit
def _row_dot(
    x_ptr, qw_ptr, s_ptr, o_ptr, rows, r_mask, K, KW, G, magic,
    BITS: tl.constexpr, GROUP: tl.constexpr, SLOTS: tl.constexpr, HAS_OFFSET: tl.constexpr,
    BN: tl.constexpr, BP: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """float32 dot products of x with the dequantized weight rows `rows`: [BN].

    SLOTS: consecutive value slots of a panel that share one group (GROUP // PANEL, at most
    all of them)."""
    VALS: tl.constexpr = 32 // BITS
    P: tl.constexpr = 16  # PANEL
    rows64 = rows.to(tl.int64)
    pb = tl.arange(0, BP)
    lane = tl.arange(0, P)
    # Tiles are [panels, rows, lanes]: with lanes the contiguous axis, Triton spreads a
    # warp's threads over lanes, then panels, so a thread holds several rows of the same
    # columns and converts (and sums) each x value once for all of them.
    acc = tl.zeros([BP, BN, P], tl.float32)
    # Software-pipelined: every load of the next STAGES - 1 steps is in flight (cp.async into
    # shared memory) while a step computes, and reading it back from shared memory serves
    # whatever register layout each operand needs.
    for p0 in tl.range(0, KW // P, BP, num_stages=STAGES):
        panel = p0 + pb
        p_mask = panel < KW // P
        mask = p_mask[:, None, None] & r_mask[None, :, None]
        words = tl.load(
            qw_ptr + rows64[None, :, None] * KW + (panel[:, None] * P + lane[None, :])[:, None, :],
            mask=mask, other=0,
        )  # fmt: skip
        high = words >> 16
        part = tl.zeros([BP, BN, P], tl.float32)
        x_sum = tl.zeros([BP, P], tl.float32)
        for j in tl.static_range(VALS):
            col = panel[:, None] * (P * VALS) + j * P + lane[None, :]
            xj = tl.load(x_ptr + col, mask=col < K, other=0.0).to(tl.float32)
            x_scaled = xj * (1.0 / (1 << (j % (16 // BITS) * BITS)))  # exact: a power of 2
            part += _slot_values(words, high, magic, j, BITS) * x_scaled[:, None, :]
            if HAS_OFFSET:
                x_sum += xj
            if j % SLOTS == SLOTS - 1:  # the last slot of a group: apply its scale, offset
                grp = (panel * (P * VALS) + (j + 1 - SLOTS) * P) // GROUP
                g_mask = (p_mask & (grp < G))[:, None] & r_mask[None, :]
                g_off = rows64[None, :] * G + grp[:, None]
                scale = tl.load(s_ptr + g_off, mask=g_mask, other=0.0).to(tl.float32)
                acc += part * scale[:, :, None]
                part = tl.zeros([BP, BN, P], tl.float32)
                if HAS_OFFSET:
                    offset = tl.load(o_ptr + g_off, mask=g_mask, other=0.0).to(tl.float32)
                    acc += offset[:, :, None] * x_sum[:, None, :]
                    x_sum = tl.zeros([BP, P], tl.float32)
    return tl.sum(tl.sum(acc, 2), 0)


@triton.jit
def _qgemv_kernel(
    x_ptr, qw_ptr, s_ptr, o_ptr, b_ptr, y_ptr, N, K, KW, G, MAGIC,
    BITS: tl.constexpr, GROUP: tl.constexpr, SLOTS: tl.constexpr, HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """y = W x (+ b) for rows BN*pid..; with SILU_MUL, W holds gate rows then N up rows and
    y = silu(W_gate x) * (W_up x)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    r_mask = rows < N
    y = _row_dot(
        x_ptr, qw_ptr, s_ptr, o_ptr, rows, r_mask, K, KW, G, MAGIC,
        BITS, GROUP, SLOTS, HAS_OFFSET, BN, BP, STAGES,
    )  # fmt: skip
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
    if SILU_MUL:
        up = _row_dot(
            x_ptr, qw_ptr, s_ptr, o_ptr, rows + N, r_mask, K, KW, G, MAGIC,
            BITS, GROUP, SLOTS, HAS_OFFSET, BN, BP, STAGES,
        )  # fmt: skip
        # Both projections round to the model dtype first, as the unfused path's matmul does.
        y = _silu_mul(y.to(dtype), up.to(dtype), dtype)
    tl.store(y_ptr + rows, y.to(dtype), mask=r_mask)


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return SM_COUNT_FALLBACK
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv_config(n: int, k: int, bits: int, sms: int) -> GemvConfig:
    """Rows and panels per program step from the shape alone (launch parameters never depend
    on data, so the kernel can be captured in CUDA graphs).

    What keeps HBM busy is the bytes in flight: steps of ~8 KB a program (16 words a
    thread, as the bf16 GEMV's 7B steps), num_stages - 1 of them loading ahead, and at least
    two programs an SM."""
    row_panels = triton.cdiv(k * bits // 32, PANEL)
    panels = min(triton.next_power_of_2(row_panels), 16)
    # Each x slot load needs >= 2 values (4 bytes) a thread to be pipelined (cp.async moves
    # 4 bytes or more): at most one warp per 4 panels.
    warps = min(4, max(1, panels // 4))
    rows = max(1, 512 * warps // (panels * PANEL))  # 16 words a thread
    while rows > 1 and triton.cdiv(n, rows) < 2 * sms:
        rows //= 2
    warps = min(warps, max(1, rows * panels * PANEL // 256))  # >= 8 words a thread
    return GemvConfig(rows, panels, warps)


def kernel_group(w) -> int:
    """The group size the kernels divide by: per channel (one group), any power of two that
    no column index reaches."""
    if w.scales.shape[1] == 1:
        return triton.next_power_of_2(w.qweight.shape[1] * 32 // w.bits)
    return w.group_size


def launch_gemv(
    x: torch.Tensor, w, bias: torch.Tensor | None, silu_mul: bool, config: GemvConfig | None
) -> torch.Tensor:
    """x [1, K] times the packed weight: [1, N], or [1, N // 2] with silu_mul."""
    n = w.out_features // 2 if silu_mul else w.out_features
    cfg = config or gemv_config(w.out_features, w.in_features, w.bits, sm_count(x.device))
    group = kernel_group(w)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _qgemv_kernel[(triton.cdiv(n, cfg.rows),)](
        x.contiguous(), w.qweight, w.scales, w.scales if w.offsets is None else w.offsets,
        w.scales if bias is None else bias, y, n, w.in_features, w.qweight.shape[1],
        w.scales.shape[1], MAGIC_2_23, BITS=w.bits, GROUP=group,
        SLOTS=min(group // PANEL, 32 // w.bits), HAS_OFFSET=w.offsets is not None,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        BN=cfg.rows, BP=cfg.panels, STAGES=cfg.num_stages, num_warps=cfg.num_warps,
    )  # fmt: skip
    return y
