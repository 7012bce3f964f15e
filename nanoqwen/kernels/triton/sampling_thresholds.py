"""Filter thresholds for the sampler: top-k, top-p and min-p each keep the processed logits
z >= some threshold, so together they keep z >= the largest of the three.

_candidates_kernel gives each vocabulary tile its candidates: its values above the tile's
floor, at most CANDIDATES. _thresholds_kernel, a program a row, then keeps the union's
values above a floor of its own, at most CANDIDATES, sorted; those above c, the largest tile
floor, are the row's largest exactly. From them it derives the thresholds as the reference's
sorted rule does (_row_thresholds): top-k's is the k-th value; top-p's the value where the
cumulative renormalised mass first reaches p; min-p's max(z) + log(min_p). A row whose
boundary lies past the exact values (a larger top-k, a top-p mass they do not reach, ties
with the k-th beyond them) is flagged, and the same program searches its thresholds
(_finish_row): over the union of every tile's candidates where that
holds them, else over the whole row; other rows only take the largest of their three. A
top-p boundary below every candidate is left open: a step's draw decides such a row without
it (nucleus_draw.py); its exact threshold (Sampler.filtered_logits) comes from a search over
the whole row, split over many programs a row (row_search.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanoqwen.kernels import sampling_layout as layout
from nanoqwen.kernels.triton.row_search import search_rows
from nanoqwen.kernels.triton.select import from_ordered_key, ordered_key, store_above

F_TOP_P = tl.constexpr(layout.F_TOP_P)
F_MIN_P = tl.constexpr(layout.F_MIN_P)
NUM_F = tl.constexpr(layout.NUM_F)
I_TOP_K = tl.constexpr(layout.I_TOP_K)
NUM_I = tl.constexpr(layout.NUM_I)
PROBES = 8  # thresholds a search pass measures at once
COMPACT = 256  # candidates a row's union is packed into where they fit
SEARCH_BLOCK = 2048  # values a search loads at a time
WARPS = 8  # the thresholds kernel's: at 16 its registers (128 a thread) spill


@triton.jit
def _at(values, idx, i):
    return tl.sum(tl.where(idx == i, values, 0.0), axis=0)


@triton.jit
def _candidates_kernel(
    z_ptr, part_max_ptr, bound_ptr, cand_ptr, floor_ptr, count_ptr, slots_ptr, iparams_ptr,
    vocab, num_tiles, CAP: tl.constexpr, BLOCK: tl.constexpr, OPEN_P: tl.constexpr,
):  # fmt: skip
    """Each tile's candidates: its values above a floor, at most CAP (select.store_above), and
    how many. A tile whose max is under the row's bound (from sample._reduce_row) holds
    none of the row's values the filters read: it is skipped, with its max as its floor.
    With top-k 20 most tiles are, and the others keep no value under the bound either. With
    OPEN_P, rows without top-k need none (_thresholds_kernel)."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    if OPEN_P:  # noqa: SIM102 (a compile-time guard: Triton's `and` would not be)
        if tl.load(iparams_ptr + tl.load(slots_ptr + row) * NUM_I + I_TOP_K) >= vocab:
            return
    part = row * num_tiles + tile
    out = cand_ptr + part * CAP
    tile_max = tl.load(part_max_ptr + part)
    bound = tl.load(bound_ptr + row)
    if tile_max < bound:
        tl.store(out + tl.arange(0, CAP), tl.full([CAP], float("-inf"), tl.float32))
        tl.store(floor_ptr + part, tile_max)
        tl.store(count_ptr + part, 0)
        return
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(z_ptr + row * vocab + offs, mask=offs < vocab, other=float("-inf"))
    # Just under the bound: the row's top-k values are at or above it.
    lowest = tl.where(bound > float("-inf"), from_ordered_key(ordered_key(bound) - 1), bound)
    floor = store_above(x, tile_max, out, CAP, lowest)
    tl.store(floor_ptr + part, floor)
    tl.store(count_ptr + part, tl.sum((x > floor).to(tl.int32), axis=0))


@triton.jit
def _row_floor(floor_ptr, row, num_tiles, TILES: tl.constexpr):
    """c: the largest of the row's tile floors; every token above it is a candidate."""
    t = tl.arange(0, TILES)
    floors = tl.load(floor_ptr + row * num_tiles + t, mask=t < num_tiles, other=float("-inf"))
    return tl.max(floors, axis=0)


@triton.jit
def _row_thresholds(
    row, slot, cand_ptr, floor_ptr, count_ptr, num_tiles, packed_ptr, top_ptr, m, s_ptr,
    fparams_ptr, iparams_ptr, vocab,
    CAP: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr, OPEN_P: tl.constexpr,
    COMPACT: tl.constexpr,
):  # fmt: skip
    """(tau_k, tau_p, tau_min, need) of a row from its candidates. With OPEN_P, a row
    without top-k reads none: its top-p is left open (need bit 3) for nucleus_draw.py,
    which needs no threshold."""
    top_k = tl.load(iparams_ptr + slot * NUM_I + I_TOP_K)
    top_p = tl.load(fparams_ptr + slot * NUM_F + F_TOP_P)
    min_p = tl.load(fparams_ptr + slot * NUM_F + F_MIN_P)
    tau_min = tl.where(min_p > 0, m + tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))
    tau_k = tl.full((), float("-inf"), tl.float32)
    tau_p = tl.full((), float("-inf"), tl.float32)
    need = tl.where(top_p < 1.0, 4, 0)
    skip = top_k < 0  # False, as a value of the type the line below gives it
    if OPEN_P:
        skip = top_k >= vocab
    if not skip:
        num_cands = num_tiles * CAP
        idx = tl.arange(0, CAP)
        # The union's values above a floor that leaves at most CAP of them, through memory
        # (top_ptr: [rows, CAP]), then sorted: its largest, without the 32 block-wide
        # reductions of an exact CAP largest (a bisection took 20.5 µs a step at batch 1).
        # Where they fit, the tiles' candidates are packed into COMPACT places first (most
        # tiles store none or a few), so the selection reads COMPACT values rather than every
        # tile's CAP.
        t = tl.arange(0, TILES)
        counts = tl.load(count_ptr + row * num_tiles + t, mask=t < num_tiles, other=0)
        n = tl.sum(counts, axis=0)
        if n <= COMPACT:
            packed_row = packed_ptr + row * COMPACT
            place = tl.arange(0, CAP)[None, :]
            stored = place < counts[:, None]
            cands = tl.load(cand_ptr + (row * num_tiles + t[:, None]) * CAP + place,
                            mask=stored)  # fmt: skip
            starts = tl.cumsum(counts, axis=0) - counts
            tl.store(packed_row + starts[:, None] + place, cands, mask=stored)
            i = tl.arange(0, COMPACT)
            tl.store(packed_row + i, tl.full([COMPACT], float("-inf"), tl.float32),
                     mask=i >= n)  # fmt: skip
            tl.debug_barrier()  # every thread's stores, before any thread reads them back
            packed = tl.load(packed_row + i)
            store_above(packed, tl.max(packed, axis=0), top_ptr + row * CAP, CAP)
        else:
            offs = tl.arange(0, BLOCK)
            merged = tl.load(cand_ptr + row * num_cands + offs, mask=offs < num_cands,
                             other=float("-inf"))  # fmt: skip
            store_above(merged, tl.max(merged, axis=0), top_ptr + row * CAP, CAP)
        tl.debug_barrier()  # every thread's stores, before any thread reads them back
        values = tl.sort(tl.load(top_ptr + row * CAP + idx), descending=True)
        # values[i] is the row's (i+1)-th largest while it is above c (every value of the
        # row above c is in the union, and every one of the union above the floor is in
        # values).
        c = _row_floor(floor_ptr, row, num_tiles, TILES)
        exact = tl.sum((values > c).to(tl.int32), axis=0)
        k_on = top_k < vocab
        k_inside = k_on & (top_k <= exact)
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
        # Past what the exact values tell: a larger top-k; a top-p whose mass they do not
        # reach (the mass before value `exact` depends on exact values only); ties with the
        # k-th beyond the CAP values.
        k_past = k_on & (top_k > exact)
        tie_past = k_inside & (_at(values, idx, CAP - 1) >= tau_k) & (vocab > CAP)
        p_short = (top_k >= vocab) & (_at(cum, idx, exact - 1) < top_p)
        p_past = p_on & (p_short | k_past | tie_past)
        need = k_past.to(tl.int32) | (p_past.to(tl.int32) << 1)
    return tau_k, tau_p, tau_min, need


@triton.jit
def _values(ptr, start, n, floor, bound, BLOCK: tl.constexpr):
    """ptr[start:start + BLOCK], with -inf for what is past n, at most floor or below bound.
    The loops below load the next block before they use this one: one program reads a
    whole row, so it would otherwise wait out a memory latency per block."""
    offs = start + tl.arange(0, BLOCK)
    x = tl.load(ptr + offs, mask=offs < n, other=float("-inf"))
    return tl.where((x > floor) & (x >= bound), x, float("-inf"))


@triton.jit
def _total(ptr, n, floor, bound, m, MASS: tl.constexpr, BLOCK: tl.constexpr):
    """Over the values x of ptr[:n] with x > floor and x >= bound: the sum of exp(x - m)
    (MASS) or their count."""
    total = tl.zeros([BLOCK], dtype=tl.float32)  # summed across threads once, at the end
    ahead = _values(ptr, 0, n, floor, bound, BLOCK)
    for start in range(0, n, BLOCK):
        x = ahead
        ahead = _values(ptr, start + BLOCK, n, floor, bound, BLOCK)
        if MASS:
            total += tl.exp(x - m)
        else:
            total += (x > float("-inf")).to(tl.float32)
    return tl.sum(total, axis=0)


@triton.jit
def _search(
    ptr, n, floor, bound, lo_key, hi_key, m, target,
    MASS: tl.constexpr, PROBES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The largest v in [lo_key, hi_key) (float order keys) with measure(x >= v) >= target,
    measure as _total's; lo_key when none. Each pass over the values measures PROBES evenly
    spaced keys at once and keeps the piece between the last that reaches the target and the
    next: ~32 / log2(PROBES) passes. The measure only changes at values, so the answer keeps
    exactly the values the sorted rule keeps, ties included."""
    j = tl.arange(0, PROBES).to(tl.int64)
    while hi_key - lo_key > 1:
        step = (hi_key - lo_key + PROBES - 1) // PROBES
        keys = lo_key + j * step
        probes = from_ordered_key(keys)
        acc = tl.zeros([PROBES, BLOCK], dtype=tl.float32)
        ahead = _values(ptr, 0, n, floor, bound, BLOCK)
        for start in range(0, n, BLOCK):
            x = ahead
            ahead = _values(ptr, start + BLOCK, n, floor, bound, BLOCK)
            keep = (x[None, :] >= probes[:, None]) & (x[None, :] > float("-inf"))
            if MASS:
                acc += tl.where(keep, tl.exp(x - m)[None, :], 0.0)
            else:
                acc += keep.to(tl.float32)
        measure = tl.sum(acc, axis=1)  # across threads once a pass, not once a block
        reached = (measure >= target) & (keys < hi_key)
        lo_key = tl.max(tl.where(reached, keys, lo_key), axis=0)
        hi_key = tl.minimum(lo_key + step, hi_key)
    return from_ordered_key(lo_key)


@triton.jit
def _finish_row(
    row, slot, need, tau_k, tau_p, tau_min, z_ptr, cand_ptr, floor_ptr, num_tiles, fparams_ptr,
    iparams_ptr, m, s_ptr, tau_ptr, tau_k_ptr, vocab, search_keys_ptr, search_target_ptr,
    pending_ptr, CAP: tl.constexpr, PROBES: tl.constexpr, BLOCK: tl.constexpr,
    TILES: tl.constexpr,
):  # fmt: skip
    """The row's threshold: the largest of its three, after a search for a flagged row (need
    bit 1: top-k, bit 2: top-p; bit 3: top-p without top-k, left open). The search runs over
    the union of the tiles' candidates where that holds the answer: every token above c, the
    largest of the tiles' floors, is a candidate, so a threshold above c is found among them
    (a top-p nucleus of hundreds or thousands of tokens, as a trained model's flatter rows
    have). Otherwise, over the row: a top-k count here; a top-p boundary there is left open
    (pending): a step draws such a row without it (nucleus_draw.py), an exact threshold comes
    from row_search.py's programs, after this kernel (this one leaves the row's key range in
    search_keys and its target in search_target)."""
    search_lo = tl.zeros((), tl.int64)
    search_hi = tl.zeros((), tl.int64)
    target = tl.zeros((), tl.float32)
    if need != 0:
        z_row = z_ptr + row * vocab
        num_cands = num_tiles * CAP
        union = cand_ptr + row * num_cands
        c = _row_floor(floor_ptr, row, num_tiles, TILES)
        above_c = ordered_key(c) + 1
        top_key = ordered_key(m) + 1
        no_bound = tl.full((), float("-inf"), tl.float32)
        if (need & 1) != 0:  # count instead of sort
            k = tl.load(iparams_ptr + slot * NUM_I + I_TOP_K).to(tl.float32)
            if _total(union, num_cands, c, no_bound, m, False, BLOCK) >= k:
                tau_k = _search(union, num_cands, c, no_bound, above_c, top_key, m, k, False,
                                PROBES, BLOCK)  # fmt: skip
            else:
                below_c = tl.minimum(above_c, top_key)  # the k-th value is c or less
                tau_k = _search(z_row, vocab, no_bound, no_bound, ordered_key(no_bound), below_c,
                                m, k, False, PROBES, BLOCK)  # fmt: skip
        if (need & 4) != 0:  # top-p without top-k, left open
            target = tl.load(fparams_ptr + slot * NUM_F + F_TOP_P) * tl.load(s_ptr + row)
        if (need & 2) != 0:
            # top-p over the top-k survivors, renormalised: their mass
            union_mass = _total(union, num_cands, c, tau_k, m, True, BLOCK)
            if tau_k > c:
                kept = union_mass  # every survivor is in the union
            elif tau_k == float("-inf"):
                kept = tl.load(s_ptr + row)
            else:
                kept = _total(z_row, vocab, no_bound, tau_k, m, True, BLOCK)
            target = tl.load(fparams_ptr + slot * NUM_F + F_TOP_P) * kept
            lo_key = ordered_key(tau_k)
            if union_mass >= target:
                tau_p = _search(union, num_cands, c, tau_k, tl.maximum(lo_key, above_c),
                                top_key, m, target, True, PROBES, BLOCK)  # fmt: skip
            else:
                search_lo = lo_key
                search_hi = tl.minimum(above_c, top_key)
                # A range of one key or none holds the answer already; else row_search.py.
                tau_p = from_ordered_key(lo_key)
                if search_hi - search_lo <= 1:
                    search_hi = search_lo
                else:
                    tau_p = tl.full((), float("-inf"), tl.float32)
    tau = tl.maximum(tl.maximum(tau_k, tau_p), tau_min)
    tl.store(tau_ptr + row, tau)
    # For row_search.py: tau_k bounds its values (tau_k_ptr holds it), lo = hi is no search.
    tl.store(tau_k_ptr + row, tau_k)
    tl.store(search_keys_ptr + row * 2, search_lo)
    tl.store(search_keys_ptr + row * 2 + 1, search_hi)
    tl.store(search_target_ptr + row, target)
    tl.store(pending_ptr + row, ((search_hi > search_lo) | ((need & 4) != 0)).to(tl.int32))


@triton.jit
def _thresholds_kernel(
    cand_ptr, floor_ptr, count_ptr, num_tiles, packed_ptr, top_ptr, z_ptr, m_ptr, s_ptr,
    slots_ptr, fparams_ptr, iparams_ptr, tau_ptr, tau_k_ptr, vocab, search_keys_ptr,
    search_target_ptr, pending_ptr,
    CAP: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr, OPEN_P: tl.constexpr,
    COMPACT: tl.constexpr, PROBES: tl.constexpr, SEARCH: tl.constexpr,
):  # fmt: skip
    """A program a row: its thresholds from the candidates, then the searches of a flagged
    row, in one launch."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    m = tl.load(m_ptr + row)
    tau_k, tau_p, tau_min, need = _row_thresholds(
        row, slot, cand_ptr, floor_ptr, count_ptr, num_tiles, packed_ptr, top_ptr, m, s_ptr,
        fparams_ptr, iparams_ptr, vocab, CAP, BLOCK, TILES, OPEN_P, COMPACT,
    )  # fmt: skip
    _finish_row(
        row, slot, need, tau_k, tau_p, tau_min, z_ptr, cand_ptr, floor_ptr, num_tiles,
        fparams_ptr, iparams_ptr, m, s_ptr, tau_ptr, tau_k_ptr, vocab, search_keys_ptr,
        search_target_ptr, pending_ptr, CAP, PROBES, SEARCH, TILES,
    )  # fmt: skip


@dataclass
class OpenRows:
    """Rows whose top-p boundary lies below every candidate, left open by thresholds():
    pending [rows] int32 (1: open), bound [rows] float32 (top-k's threshold, which bounds the
    mass top-p counts) and target [rows] float32 (top_p times the top-k survivors' mass)."""

    pending: torch.Tensor
    bound: torch.Tensor
    target: torch.Tensor


def thresholds(z: torch.Tensor, parts, slots: torch.Tensor, state, candidates: int, exact: bool):
    """(tau [rows], OpenRows) from z and the sampling._Partials of its prepare and first
    reduce passes (the tile maxima, the row max m, the sum of exp(z - m) and the candidates'
    bound). With exact, row_search.py finds the open rows' top-p thresholds and raises tau;
    else tau leaves top-p out of the open rows, for nucleus_draw.py."""
    rows, vocab = z.shape
    tiles = parts.tiles
    _candidates_kernel[(rows, tiles)](
        z, parts.max, parts.bound, parts.cand, parts.floor, parts.count, slots, state.iparams,
        vocab, tiles, CAP=candidates, BLOCK=parts.tile, OPEN_P=not exact, num_warps=4,
    )  # fmt: skip
    num_cands = tiles * candidates
    f32 = dict(dtype=torch.float32, device=z.device)
    tau_k, tau = torch.empty(rows, **f32), torch.empty(rows, **f32)
    top = torch.empty(rows, candidates, **f32)
    packed = torch.empty(rows, COMPACT, **f32)
    search_keys = torch.empty(rows, 2, dtype=torch.int64, device=z.device)
    search_target = torch.empty(rows, **f32)
    pending = torch.empty(rows, dtype=torch.int32, device=z.device)
    _thresholds_kernel[(rows,)](
        parts.cand, parts.floor, parts.count, tiles, packed, top, z, parts.m, parts.s, slots,
        state.fparams, state.iparams, tau, tau_k, vocab, search_keys, search_target, pending,
        CAP=candidates, BLOCK=max(triton.next_power_of_2(num_cands), candidates),
        TILES=triton.next_power_of_2(tiles), OPEN_P=not exact, COMPACT=COMPACT, PROBES=PROBES,
        SEARCH=SEARCH_BLOCK, num_warps=WARPS,
    )  # fmt: skip
    if exact:
        search_rows(z, search_keys, tau_k, parts.m, search_target, tau)
    return tau, OpenRows(pending, tau_k, search_target)
