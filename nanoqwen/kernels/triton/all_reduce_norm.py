"""The low-latency all-reduce (all_reduce_ll.py) of a row-parallel layer's partial sums, fused
with the residual add and RMSNorm that follow it: one kernel where a tensor-parallel decode
step otherwise runs two (the all-reduce, then kernels/triton/rms_norm.py), 2 x layers times a step.

Each program owns one whole row (a token's hidden state): it sends the row's packets to every
rank, sums what arrives as all_reduce_ll.py does (float32, rank order, rounded once: the
all-reduce's own result), then adds the residual and normalizes with HF's roundings, as
rms_norm.py does. The words hold two 16-bit values (or one float32), so the add and norm run
on the two halves of each word side by side. The sum of squares adds the halves in another
order than rms_norm.py's, so the normalized output may differ from the unfused pair's in the
last bit; the all-reduced sums and the residual stream are the same bits.

Programs share all_reduce_ll.py's buffers, epochs and protocol: program j here is program j
there, and the same calls on every rank keep every program's epoch the same everywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from nanoqwen.kernels.triton.all_reduce_ll import (
    KINDS,
    LowLatencyBuffers,
    begin_call,
    end_call,
    halves,
    receive_sums,
    send_packets,
    to_word,
)

# Rows this fuses: up to 4,096 words (8,192 bf16 values: every Qwen2.5 size's hidden state).
ROW_WORDS = 4096


@triton.jit
def _all_reduce_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, words, n_cols, eps, ptrs_ptr, state_ptr, failed_ptr, rank,
    timeout, WORLD: tl.constexpr, G_MAX: tl.constexpr, REGION: tl.constexpr,
    BLOCK: tl.constexpr, KIND: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    USE_CLOCK: tl.constexpr,
):  # fmt: skip
    flag, base, failed, verdict = begin_call(state_ptr, failed_ptr, G_MAX, WORLD)
    row = tl.program_id(0).to(tl.int64) * words
    idx = tl.arange(0, BLOCK)
    mask = idx < words
    send_packets(x_ptr + row, idx, mask, flag, base, ptrs_ptr, rank, WORLD, REGION)
    # Read while the packets cross the link: after the wait only the arithmetic is left.
    w_words = tl.load(w_ptr + idx, mask=mask, other=0)
    if HAS_RESIDUAL:
        r_words = tl.load(res_ptr + row + idx, mask=mask, other=0)
    t0 = globaltimer() if USE_CLOCK else 0
    spins = tl.full([], 0, tl.int32)  # a tensor, as receive_sums's loop carries it
    lo, hi, gave_up, _ = receive_sums(
        idx, mask, flag, base, ptrs_ptr, rank, failed, spins, t0, verdict, timeout, WORLD,
        REGION, KIND, USE_CLOCK,
    )  # fmt: skip
    summed = to_word(lo, hi, KIND)  # the all-reduce's result, in the model's dtype
    if HAS_RESIDUAL:
        # The residual stream after the add, rounded to the model dtype as HF's add is.
        r_lo, r_hi = halves(r_words, KIND)
        s_lo, s_hi = halves(summed, KIND)
        summed = to_word(s_lo + r_lo, s_hi + r_hi, KIND)
        tl.store(res_ptr + row + idx, summed, mask=mask)
    else:  # the summed input is the residual stream
        tl.store(x_ptr + row + idx, summed, mask=mask)
    a, b = halves(summed, KIND)
    var = tl.sum(a * a + b * b, axis=0) / n_cols
    inv = tl.rsqrt(var + eps)
    # Normalized in float32, rounded to the model dtype before the weight multiply (HF's).
    n_lo, n_hi = halves(to_word(a * inv, b * inv, KIND), KIND)
    w_lo, w_hi = halves(w_words, KIND)
    tl.store(out_ptr + row + idx, to_word(n_lo * w_lo, n_hi * w_hi, KIND), mask=mask)
    end_call(gave_up, failed, failed_ptr, ptrs_ptr, WORLD)


def fits(x: torch.Tensor, g_max: int, region: int) -> bool:
    """Whether the kernel takes x [rows, cols]: whole 4-byte words per row, a row per
    program (every program resident), a row within a region."""
    rows, cols = x.shape
    words = cols * x.element_size() // 4
    return (
        x.dtype in KINDS
        and cols * x.element_size() % 4 == 0
        and 0 < rows <= g_max
        and words <= min(region, ROW_WORDS)
    )


def all_reduce_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    buffers: LowLatencyBuffers,
) -> torch.Tensor:
    """x [rows, cols] (this rank's partial sums, contiguous, fits()) summed over the ranks,
    then RMSNorm(x + residual) with weight: returns the normalized rows, and leaves the
    residual stream in residual (updated in place) or, without one, in x (summed in place)."""
    rows, cols = x.shape
    words = cols * x.element_size() // 4
    block = triton.next_power_of_2(words)
    out = torch.empty_like(x)
    res = residual if residual is not None else x
    buffers.launch(
        _all_reduce_rms_norm_kernel, (rows,), x.view(torch.int32), res.view(torch.int32),
        weight.view(torch.int32), out.view(torch.int32), words, cols, eps,
        BLOCK=block, KIND=KINDS[x.dtype],
        HAS_RESIDUAL=residual is not None, num_warps=min(16, max(4, block // 256)),
    )  # fmt: skip
    return out
