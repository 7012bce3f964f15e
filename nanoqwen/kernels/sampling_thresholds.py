"""Filter thresholds for the sampler: top-k, top-p and min-p each keep the processed logits
z >= some threshold, so together they keep z >= the largest of the three.

_thresholds_kernel merges the tiles' candidates (each tile's largest values, from
sampling._prepare_kernel) into the row's CANDIDATES largest, sorted, and derives the
thresholds from them as the reference's sorted rule does: top-k's is the k-th value; top-p's
the value where the cumulative renormalised mass first reaches p; min-p's max(z) + log(min_p).
A row whose boundary lies past the candidates (a larger top-k, a top-p mass they do not reach,
ties with the k-th beyond them) is flagged, and _finish_kernel finds its thresholds by
bisection over the whole row; other rows only take the largest of their three.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoqwen.kernels import sampling_layout as layout

F_TOP_P = tl.constexpr(layout.F_TOP_P)
F_MIN_P = tl.constexpr(layout.F_MIN_P)
NUM_F = tl.constexpr(layout.NUM_F)
I_TOP_K = tl.constexpr(layout.I_TOP_K)
NUM_I = tl.constexpr(layout.NUM_I)


@triton.jit
def _at(values, idx, i):
    return tl.sum(tl.where(idx == i, values, 0.0), axis=0)


@triton.jit
def _thresholds_kernel(
    cand_ptr, num_cands, m_ptr, s_ptr, slots_ptr, fparams_ptr, iparams_ptr,
    tau_k_ptr, tau_p_ptr, tau_min_ptr, need_ptr, vocab,
    CAP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    merged = tl.load(cand_ptr + row * num_cands + offs, mask=offs < num_cands, other=float("-inf"))
    values = tl.topk(merged, CAP)  # sorted, largest first
    idx = tl.arange(0, CAP)
    slot = tl.load(slots_ptr + row)
    top_k = tl.load(iparams_ptr + slot * NUM_I + I_TOP_K)
    top_p = tl.load(fparams_ptr + slot * NUM_F + F_TOP_P)
    min_p = tl.load(fparams_ptr + slot * NUM_F + F_MIN_P)
    m = tl.load(m_ptr + row)
    k_on = top_k < vocab
    k_inside = k_on & (top_k <= CAP)
    tau_k = tl.where(k_inside, _at(values, idx, top_k - 1), float("-inf"))
    # top-p over the top-k survivors, renormalised (HF); without top-k, over the row.
    e = tl.where(values >= tau_k, tl.exp(values - m), 0.0)
    total = tl.where(k_inside, tl.sum(e, axis=0), tl.load(s_ptr + row))
    probs = e / total
    cum = tl.cumsum(probs, 0)
    before = cum - probs
    p_on = top_p < 1.0
    kept = tl.maximum(tl.sum((before < top_p).to(tl.int32), axis=0), 1)
    tau_p = tl.where(p_on, _at(values, idx, kept - 1), float("-inf"))
    k_past = k_on & (top_k > CAP)
    tie_past = k_inside & (_at(values, idx, CAP - 1) >= tau_k) & (vocab > CAP)
    p_past = p_on & (((top_k >= vocab) & (_at(cum, idx, CAP - 1) < top_p)) | k_past | tie_past)
    tl.store(tau_k_ptr + row, tau_k)
    tl.store(tau_p_ptr + row, tau_p)
    tl.store(
        tau_min_ptr + row, tl.where(min_p > 0, m + tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))
    )
    tl.store(need_ptr + row, k_past.to(tl.int32) | (p_past.to(tl.int32) << 1))


@triton.jit
def _ordered(x):
    """float32 -> int64 key with the same order (negative floats' bits reversed)."""
    i = x.to(tl.int32, bitcast=True)
    return tl.where(i < 0, i ^ 0x7FFFFFFF, i).to(tl.int64)


@triton.jit
def _from_ordered(key):
    i = key.to(tl.int32)
    return tl.where(i < 0, i ^ 0x7FFFFFFF, i).to(tl.float32, bitcast=True)


@triton.jit
def _above(z_row, vocab, v, lo, m, MASS: tl.constexpr, BLOCK: tl.constexpr):
    """Over tokens with z >= max(v, lo): the sum of exp(z - m) (MASS) or their count."""
    total = 0.0
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(z_row + offs, mask=offs < vocab, other=float("-inf"))
        keep = (x >= v) & (x >= lo) & (x > float("-inf"))
        if MASS:
            total += tl.sum(tl.where(keep, tl.exp(x - m), 0.0), axis=0)
        else:
            total += tl.sum(keep.to(tl.float32), axis=0)
    return total


@triton.jit
def _largest_threshold(z_row, vocab, lo, m, target, MASS: tl.constexpr, BLOCK: tl.constexpr):
    """The largest v with measure(z >= v) >= target, by bisection on the float order (the
    measure only changes at token values, so the answer keeps exactly the tokens the sorted
    rule keeps, ties included)."""
    lo_key = _ordered(lo)
    hi_key = _ordered(m) + 1
    while hi_key - lo_key > 1:
        mid = lo_key + (hi_key - lo_key) // 2
        if _above(z_row, vocab, _from_ordered(mid), lo, m, MASS, BLOCK) >= target:
            lo_key = mid
        else:
            hi_key = mid
    return _from_ordered(lo_key)


@triton.jit
def _finish_kernel(
    z_ptr, need_ptr, slots_ptr, fparams_ptr, iparams_ptr, tau_k_ptr, tau_p_ptr, tau_min_ptr,
    m_ptr, tau_ptr, vocab, BLOCK: tl.constexpr,
):  # fmt: skip
    """Each row's threshold: the largest of its three, after a bisection over the whole row
    for a flagged row (need bit 1: top-k, bit 2: top-p)."""
    row = tl.program_id(0).to(tl.int64)
    need = tl.load(need_ptr + row)
    tau_k = tl.load(tau_k_ptr + row)
    tau_p = tl.load(tau_p_ptr + row)
    if need != 0:
        z_row = z_ptr + row * vocab
        m = tl.load(m_ptr + row)
        slot = tl.load(slots_ptr + row)
        if (need & 1) != 0:  # count instead of sort
            k = tl.load(iparams_ptr + slot * NUM_I + I_TOP_K).to(tl.float32)
            no_bound = tl.full((), float("-inf"), tl.float32)
            tau_k = _largest_threshold(z_row, vocab, no_bound, m, k, False, BLOCK)
        if (need & 2) != 0:
            target = tl.load(fparams_ptr + slot * NUM_F + F_TOP_P)
            target = target * _above(z_row, vocab, tau_k, tau_k, m, True, BLOCK)
            tau_p = _largest_threshold(z_row, vocab, tau_k, m, target, True, BLOCK)
    tau = tl.maximum(tl.maximum(tau_k, tau_p), tl.load(tau_min_ptr + row))
    tl.store(tau_ptr + row, tau)


def thresholds(
    z: torch.Tensor,
    cand: torch.Tensor,
    m: torch.Tensor,
    s: torch.Tensor,
    slots: torch.Tensor,
    state,
    candidates: int,
) -> torch.Tensor:
    """cand: [rows, tiles, candidates] from the prepare pass; m, s: the row max of z and the
    sum of exp(z - m). Returns tau [rows]."""
    rows, vocab = z.shape
    num_cands = cand.shape[1] * candidates
    f32 = dict(dtype=torch.float32, device=z.device)
    tau_k, tau_p, tau_min, tau = (torch.empty(rows, **f32) for _ in range(4))
    need = torch.empty(rows, dtype=torch.int32, device=z.device)
    _thresholds_kernel[(rows,)](
        cand, num_cands, m, s, slots, state.fparams, state.iparams, tau_k, tau_p, tau_min, need,
        vocab, CAP=candidates, BLOCK=max(triton.next_power_of_2(num_cands), candidates),
        num_warps=8,
    )  # fmt: skip
    _finish_kernel[(rows,)](
        z, need, slots, state.fparams, state.iparams, tau_k, tau_p, tau_min, m, tau, vocab,
        BLOCK=2048, num_warps=8,
    )  # fmt: skip
    return tau
