"""Triton passes of the device-resident sampler (runtime/sampling/sampler.py).

Each row of a batch belongs to a slot of the SamplingState, whose tables hold the request's
settings and token statistics; kernels gather them by slot, so a step needs no per-row host
data besides the slot ids. Every pass runs over [rows, vocabulary tiles], so batch 1 still
spreads over many programs.

The noise is counter-based: token t of a request at output position n draws
hash(seed, n, t) (splitmix64 finalizers), identical to runtime/sampling/noise.py, so a
seeded request samples the same tokens in any batch and on CPU or GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoqwen.kernels import sampling_layout as layout

TILE = 2048  # vocabulary entries per program

# The tables' layout (sampling_layout.py) as compile-time constants.
F_TEMPERATURE = tl.constexpr(layout.F_TEMPERATURE)
F_REPETITION = tl.constexpr(layout.F_REPETITION)
F_PRESENCE = tl.constexpr(layout.F_PRESENCE)
F_FREQUENCY = tl.constexpr(layout.F_FREQUENCY)
NUM_F = tl.constexpr(layout.NUM_F)
I_MIN_TOKENS = tl.constexpr(layout.I_MIN_TOKENS)
I_SEED = tl.constexpr(layout.I_SEED)
I_FLAGS = tl.constexpr(layout.I_FLAGS)
NUM_I = tl.constexpr(layout.NUM_I)
FLAG_GREEDY = tl.constexpr(layout.FLAG_GREEDY)
FLAG_PENALTY = tl.constexpr(layout.FLAG_PENALTY)
FLAG_BAN = tl.constexpr(layout.FLAG_BAN)


@triton.jit
def _mix64(x):
    x = x ^ (x >> 30)
    x = x * 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27)
    x = x * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _gumbel(seed, pos, offs):
    """Gumbel(0, 1) noise for tokens offs of a request at output position pos."""
    key = _mix64(seed.to(tl.uint64, bitcast=True) + pos.to(tl.uint64) * 0x9E3779B97F4A7C15)
    bits = _mix64(key + (offs.to(tl.uint64) + 1) * 0xD1B54A32D192ED03)
    u = ((bits >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _prepare_kernel(
    logits_ptr, logits_stride, z_ptr, slots_ptr, fparams_ptr, iparams_ptr, out_pos_ptr,
    prompt_mask_ptr, counts_ptr, ban_mask_ptr,
    part_max_ptr, part_sum_ptr, part_arg_ptr, part_gval_ptr, part_gidx_ptr,
    vocab, num_tiles,
    WRITE_Z: tl.constexpr, SAMPLE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Penalties, min_tokens bans and temperature in one pass (the processed logits z), with
    per-tile partials: max, sum of exp(z - max), first argmax, and with SAMPLE the Gumbel
    argmax of z + noise (sampling with no filter)."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    x = tl.load(logits_ptr + row * logits_stride + offs, mask=inside, other=float("-inf"))
    fp = fparams_ptr + slot * NUM_F
    ip = iparams_ptr + slot * NUM_I
    flags = tl.load(ip + I_FLAGS)
    table = slot * vocab + offs
    if (flags & FLAG_PENALTY) != 0:
        counts = tl.load(counts_ptr + table, mask=inside, other=0)
        seen = (tl.load(prompt_mask_ptr + table, mask=inside, other=0) != 0) | (counts > 0)
        rep = tl.load(fp + F_REPETITION)
        x = tl.where(seen, tl.where(x < 0, x * rep, x / rep), x)
        x = x - tl.load(fp + F_FREQUENCY) * counts.to(tl.float32)
        x = x - tl.load(fp + F_PRESENCE) * (counts > 0).to(tl.float32)
    ban_active = tl.load(out_pos_ptr + slot) < tl.load(ip + I_MIN_TOKENS)
    if ((flags & FLAG_BAN) != 0) & ban_active:
        banned = tl.load(ban_mask_ptr + table, mask=inside, other=0) != 0
        x = tl.where(banned, float("-inf"), x)
    x = x / tl.load(fp + F_TEMPERATURE)
    if WRITE_Z:
        tl.store(z_ptr + row * vocab + offs, x, mask=inside)
    part = row * num_tiles + tile
    tile_max = tl.max(x, axis=0)
    tl.store(part_max_ptr + part, tile_max)
    total = tl.sum(tl.exp(x - tile_max), axis=0)
    tl.store(part_sum_ptr + part, tl.where(tile_max == float("-inf"), 0.0, total))
    tl.store(part_arg_ptr + part, tile * BLOCK + tl.argmax(x, axis=0))
    if SAMPLE:
        if (flags & FLAG_GREEDY) == 0:
            seed = tl.load(ip + I_SEED)
            score = x + _gumbel(seed, tl.load(out_pos_ptr + slot), offs)
            score = tl.where(inside & (x > float("-inf")), score, float("-inf"))
            tl.store(part_gval_ptr + part, tl.max(score, axis=0))
            tl.store(part_gidx_ptr + part, tile * BLOCK + tl.argmax(score, axis=0))
        else:
            tl.store(part_gval_ptr + part, float("-inf"))
            tl.store(part_gidx_ptr + part, tile * BLOCK)


@triton.jit
def _sample_kernel(
    z_ptr, tau_ptr, slots_ptr, iparams_ptr, out_pos_ptr, part_gval_ptr, part_gidx_ptr,
    vocab, num_tiles, BLOCK: tl.constexpr,
):  # fmt: skip
    """Gumbel argmax over the tokens with z >= tau (the row's filter threshold)."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    part = row * num_tiles + tile
    slot = tl.load(slots_ptr + row)
    ip = iparams_ptr + slot * NUM_I
    if (tl.load(ip + I_FLAGS) & FLAG_GREEDY) != 0:
        tl.store(part_gval_ptr + part, float("-inf"))
        tl.store(part_gidx_ptr + part, tile * BLOCK)
        return
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    x = tl.load(z_ptr + row * vocab + offs, mask=inside, other=float("-inf"))
    seed = tl.load(ip + I_SEED)
    score = x + _gumbel(seed, tl.load(out_pos_ptr + slot), offs)
    keep = inside & (x >= tl.load(tau_ptr + row)) & (x > float("-inf"))
    score = tl.where(keep, score, float("-inf"))
    tl.store(part_gval_ptr + part, tl.max(score, axis=0))
    tl.store(part_gidx_ptr + part, tile * BLOCK + tl.argmax(score, axis=0))


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
def _threshold_fallback_kernel(
    z_ptr, need_ptr, top_k_ptr, top_p_ptr, tau_k_ptr, tau_p_ptr, m_ptr, vocab,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Rows whose top-k / top-p boundary lies past the candidates the sampler sorted: find
    the thresholds over the whole row. Other rows return at once."""
    row = tl.program_id(0).to(tl.int64)
    need = tl.load(need_ptr + row)
    if need == 0:
        return
    z_row = z_ptr + row * vocab
    m = tl.load(m_ptr + row)
    tau_k = tl.load(tau_k_ptr + row)
    if (need & 1) != 0:  # top-k beyond the candidates: count instead of sort
        k = tl.load(top_k_ptr + row).to(tl.float32)
        no_bound = tl.full((), float("-inf"), tl.float32)
        tau_k = _largest_threshold(z_row, vocab, no_bound, m, k, False, BLOCK)
        tl.store(tau_k_ptr + row, tau_k)
    if (need & 2) != 0:  # top-p mass beyond the candidates
        total = _above(z_row, vocab, tau_k, tau_k, m, True, BLOCK)
        target = tl.load(top_p_ptr + row) * total
        tl.store(tau_p_ptr + row, _largest_threshold(z_row, vocab, tau_k, m, target, True, BLOCK))


def prepare(
    logits: torch.Tensor, slots: torch.Tensor, state, write_z: bool, sample: bool
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """Returns (z or None, (part_max, part_sum, part_arg, part_gval, part_gidx))."""
    rows, vocab = logits.shape
    tiles = triton.cdiv(vocab, TILE)
    dev = logits.device
    z = torch.empty(rows, vocab, dtype=torch.float32, device=dev) if write_z else None
    f32 = dict(dtype=torch.float32, device=dev)
    part_max, part_sum = torch.empty(rows, tiles, **f32), torch.empty(rows, tiles, **f32)
    part_gval = torch.empty(rows, tiles, **f32)
    part_arg = torch.empty(rows, tiles, dtype=torch.int32, device=dev)
    part_gidx = torch.empty(rows, tiles, dtype=torch.int32, device=dev)
    _prepare_kernel[(rows, tiles)](
        logits, logits.stride(0), z if write_z else logits, slots, state.fparams, state.iparams,
        state.out_pos, state.prompt_mask, state.counts, state.ban_mask,
        part_max, part_sum, part_arg, part_gval, part_gidx, vocab, tiles,
        WRITE_Z=write_z, SAMPLE=sample, BLOCK=TILE, num_warps=4,
    )  # fmt: skip
    return z, (part_max, part_sum, part_arg, part_gval, part_gidx)


def sample_above(
    z: torch.Tensor, tau: torch.Tensor, slots: torch.Tensor, state
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, vocab = z.shape
    tiles = triton.cdiv(vocab, TILE)
    part_gval = torch.empty(rows, tiles, dtype=torch.float32, device=z.device)
    part_gidx = torch.empty(rows, tiles, dtype=torch.int32, device=z.device)
    _sample_kernel[(rows, tiles)](
        z, tau, slots, state.iparams, state.out_pos, part_gval, part_gidx, vocab, tiles,
        BLOCK=TILE, num_warps=4,
    )  # fmt: skip
    return part_gval, part_gidx


def threshold_fallback(
    z: torch.Tensor,
    need: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    tau_k: torch.Tensor,
    tau_p: torch.Tensor,
    m: torch.Tensor,
) -> None:
    """Updates tau_k / tau_p in place for rows with need bit 1 (top-k) or 2 (top-p)."""
    rows, vocab = z.shape
    _threshold_fallback_kernel[(rows,)](
        z, need, top_k, top_p, tau_k, tau_p, m, vocab, BLOCK=TILE, num_warps=8
    )
