"""A top-p draw without its threshold.

The draw is the Gumbel-max over the kept tokens K = {z >= tau}. Top-p's tau needs the
row's sorted mass: from the 64 candidates when the nucleus lies among them, else a search
over the whole row, round after round (a flat row: random weights, or a trained model at a
high temperature, whose nucleus holds tens of thousands of tokens). The draw needs less:
start from x, the Gumbel-max over S = {z >= max(top-k's and min-p's thresholds)}, a
superset of K. Top-p keeps x exactly when the top-k survivors' mass strictly above z_x is
under top_p times their whole mass. If it does, x is the draw over K (K lies in S). If not,
z_x is below tau, so K lies in {z > z_x}: the Gumbel-max over S without the tokens up to
z_x is the next candidate, with the same noise. Each candidate is kept with probability at
least top_p, so few are tried, and the token is the one a draw over z >= tau gives. A step
draws this way every top-p row without top-k (which then reads no candidate at all) and
every row whose nucleus lies past the candidates.

A round (one launch of a fixed number of programs) shares the open rows' vocabulary tiles
out among its programs, each a run of consecutive tiles: a round with many open rows gives
each program several tiles of a row, one with a few open rows one tile each, and one with
none ends at once. For each tile a program either measures the row's mass above its
candidate (exponentials only: most rows end here) or, for a row whose candidate was passed,
the next candidate's part (the noise, for the tiles above the passed one). A program counts
its tiles of a row in (an acq_rel counter, once a run); the one that completes the count
adds the row's tiles up and decides. After ROUNDS rounds the last one's deciding program
walks on over the whole row alone until a candidate is kept (with top_p 0.9 a row needs it
about once in a thousand steps). The row's token is recorded when it is decided. A round
reads the rows' states from one buffer and writes them to the other, so that every program
of a round shares the rows out the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoqwen.kernels import sampling_layout as layout
from nanoqwen.kernels.triton.counters import zeroed_counters
from nanoqwen.kernels.triton.draw import first_max, gumbel, in_vocab, record_token, z_is_logits
from nanoqwen.kernels.triton.pdl import pdl_available

I_SEED = tl.constexpr(layout.I_SEED)
NUM_I = tl.constexpr(layout.NUM_I)
NUM_F = tl.constexpr(layout.NUM_F)
ROUNDS = 5  # measure, advance, measure, advance, measure (then the walk)
PROGRAMS = 512  # programs a round at most: four per SM of an H100/H200
WALK_BLOCK = tl.constexpr(1024)  # values the walk loads at a time (2,048 spill)

MEASURE = tl.constexpr(1)  # the row's candidate waits for its mass above
ADVANCE = tl.constexpr(2)  # the row's candidate was passed: the next one waits to be found


@triton.jit
def _mass_above(x, v, bound, m):
    """Per value: its mass if it is a top-k survivor above v, else 0."""
    return tl.where((x > v) & (x >= bound), tl.exp(x - m), 0.0)


@triton.jit
def _scores_above(x, offs, v, lo, seed, pos):
    """Per value: its Gumbel score if it may be the next candidate above v, else -inf."""
    return tl.where((x > v) & (x >= lo), x + gumbel(seed, pos, offs), float("-inf"))


@triton.jit
def _walk(z_row, vocab, v, bound, lo, m, seed, pos, BLOCK: tl.constexpr):
    """One program over the whole row: the top-k survivors' mass above v, and the next
    candidate (the Gumbel-max over z > v, z >= lo)."""
    lane = tl.arange(0, BLOCK)
    mass = tl.zeros([BLOCK], dtype=tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int64)
    ahead = tl.load(z_row + lane, mask=lane < vocab, other=float("-inf"))
    for start in range(0, vocab, BLOCK):
        offs = start + lane
        x = ahead
        # The next block's load goes out before this one's arithmetic.
        ahead = tl.load(z_row + offs + BLOCK, mask=offs + BLOCK < vocab, other=float("-inf"))
        mass += _mass_above(x, v, bound, m)
        score = _scores_above(x, offs, v, lo, seed, pos)
        better = score > best  # strictly: each lane keeps its first index of a tie
        best = tl.where(better, score, best)
        best_idx = tl.where(better, offs.to(tl.int64), best_idx)
    top = tl.max(best, axis=0)
    nxt = tl.min(tl.where(best == top, best_idx, vocab - 1), axis=0)
    return tl.sum(mass, axis=0), nxt


@triton.jit
def _round_kernel(
    z_ptr, vocab, num_tiles, rows, part_max_ptr, pending_in_ptr, pending_out_ptr, tokens_ptr,
    bound_ptr, tau_ptr, m_ptr, target_ptr, slots_ptr, iparams_ptr, out_pos_ptr, counts_ptr,
    maybe_seen_ptr, mass_ptr, gval_ptr, gidx_ptr, count_ptr, logits_ptr, logits_stride,
    fparams_ptr,
    FINAL: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, PLAIN_FROM_LOGITS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One round for each open row (pending_in: 0 decided, else its state): MEASURE its
    candidate's mass above (exponentials only), or ADVANCE past a passed candidate (the
    noise, for the tiles above it). The program that completes a row's count of tiles
    decides; with FINAL it walks on alone until a candidate is kept. A mass that is not
    below the target (NaN included) passes the candidate. With PLAIN_FROM_LOGITS, a row whose
    z is its logits (draw.z_is_logits) is read from the logits (z was not written there).
    With PDL (pdl.py) the round behind may launch at once, and this one waits for the one in
    front before its first read: every input here is an earlier kernel's output."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    r = tl.arange(0, ROWS)
    states = tl.load(pending_in_ptr + r, mask=r < rows, other=0)
    is_open = states != 0
    if pid == 0:  # a decided row stays decided; the open ones are written by their decider
        tl.store(pending_out_ptr + r, states, mask=(r < rows) & ~is_open)
    rank = tl.cumsum(is_open.to(tl.int32), axis=0) - 1
    total = tl.sum(is_open.to(tl.int32), axis=0) * num_tiles
    chunk = tl.cdiv(total, NUM_PROGRAMS)
    # The row a program's tiles belong to, loaded when it changes along the run.
    k_now = -1
    row = tl.zeros((), tl.int64)
    state = tl.zeros((), tl.int32)
    token = tl.zeros((), tl.int64)
    v = tl.zeros((), tl.float32)
    bound = tl.zeros((), tl.float32)
    lo = tl.zeros((), tl.float32)
    m = tl.zeros((), tl.float32)
    slot = tl.zeros((), tl.int64)
    seed = tl.zeros((), tl.int64)
    pos = tl.zeros((), tl.int64)
    z_row = z_ptr
    run_start = pid * chunk
    run_end = tl.minimum(run_start + chunk, total)
    for item in range(run_start, run_end):
        k = item // num_tiles
        tile = item % num_tiles
        if k != k_now:
            k_now = k
            row = tl.sum(tl.where(is_open & (rank == k), r, 0), axis=0).to(tl.int64)
            state = tl.load(pending_in_ptr + row)
            token = tl.load(tokens_ptr + row)
            bound = tl.load(bound_ptr + row)
            lo = tl.load(tau_ptr + row)
            m = tl.load(m_ptr + row)
            slot = tl.load(slots_ptr + row)
            seed = tl.load(iparams_ptr + slot * NUM_I + I_SEED)
            pos = tl.load(out_pos_ptr + slot)
            z_row = z_ptr + row * vocab
            if PLAIN_FROM_LOGITS:  # noqa: SIM102 (a compile-time guard)
                if z_is_logits(fparams_ptr + slot * NUM_F, iparams_ptr + slot * NUM_I):
                    z_row = logits_ptr + row * logits_stride
            v = tl.load(z_row + token)
        part = row * num_tiles + tile
        mass = 0.0
        best = float("-inf")
        best_idx = tile * BLOCK
        tile_max = tl.load(part_max_ptr + part)
        if (tile_max > v) & (tile_max >= lo):  # else no value of the tile counts
            offs = tile * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(z_row + offs, mask=offs < vocab, other=float("-inf"))
            if state == MEASURE:
                mass = tl.sum(_mass_above(x, v, bound, m), axis=0)
            else:
                score = _scores_above(x, offs, v, lo, seed, pos)
                best = tl.max(score, axis=0)
                best_idx = tile * BLOCK + tl.argmax(score, axis=0)
        tl.store(mass_ptr + part, mass)
        tl.store(gval_ptr + part, best)
        tl.store(gidx_ptr + part, best_idx)
        # At the end of the run's tiles of this row: every thread's stores, then one
        # release-acquire count of them; the program that completes the row sees them all.
        if (item == run_end - 1) | (tile == num_tiles - 1):
            tl.debug_barrier()
            done = tile + 1 - tl.maximum(run_start - k * num_tiles, 0)
            if tl.atomic_add(count_ptr + row, done, sem="acq_rel") == num_tiles - done:
                tl.store(count_ptr + row, 0)
                _decide(z_row, vocab, num_tiles, row, state, token, bound, lo, m, seed, pos,
                        slot, target_ptr, mass_ptr, gval_ptr, gidx_ptr, pending_out_ptr,
                        tokens_ptr, counts_ptr, maybe_seen_ptr, out_pos_ptr, FINAL,
                        TILES)  # fmt: skip


@triton.jit
def _decide(
    z_row, vocab, num_tiles, row, state, token, bound, lo, m, seed, pos, slot, target_ptr,
    mass_ptr, gval_ptr, gidx_ptr, pending_out_ptr, tokens_ptr, counts_ptr, maybe_seen_ptr,
    out_pos_ptr, FINAL: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """A row's decision over its tiles' parts: a measured candidate kept (the row decided) or
    passed; a passed one's next candidate found. With FINAL, the walk."""
    idx = tl.arange(0, TILES)
    at = row * num_tiles + idx
    inside = idx < num_tiles
    target = tl.load(target_ptr + row)
    if state == MEASURE:
        masses = tl.load(mass_ptr + at, mask=inside, other=0.0, cache_modifier=".cg")
        state = tl.where(tl.sum(masses, axis=0) >= target, ADVANCE, 0)
    else:
        gval = tl.load(gval_ptr + at, mask=inside, other=float("-inf"), cache_modifier=".cg")
        gidx = tl.load(gidx_ptr + at, mask=inside, other=0, cache_modifier=".cg")
        _, nxt = first_max(gval, gidx, idx, num_tiles)
        token = in_vocab(nxt, vocab).to(tl.int64)
        state = tl.zeros((), tl.int32) + MEASURE
    if FINAL:
        # Each candidate lies strictly above the one before, so the walk ends; the cap only
        # guards rows whose values are not numbers.
        walked = 0
        while (state != 0) & (walked < vocab):
            total, after = _walk(z_row, vocab, tl.load(z_row + token), bound, lo, m, seed, pos,
                                 WALK_BLOCK)  # fmt: skip
            kept = (state == MEASURE) & ~(total >= target)
            token = tl.where(kept, token, after)
            state = tl.where(kept, 0, MEASURE)
            walked += 1
        state = state * 0
    tl.store(pending_out_ptr + row, state)
    if state == 0:
        record_token(token, row, slot, tokens_ptr, counts_ptr, maybe_seen_ptr, out_pos_ptr,
                     vocab)  # fmt: skip
    else:
        tl.store(tokens_ptr + row, token)


def draw_open_rows(
    z: torch.Tensor, tokens: torch.Tensor, pending: torch.Tensor, bound, tau, m, target, slots,
    state, part_max: torch.Tensor, tile: int, logits: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """tokens: [rows] int64, each open row's first candidate (the Gumbel-max over z >= tau);
    pending: [rows] int32, 1 for an open row; bound (top-k's threshold), tau (the draw's
    lower threshold without top-p), m (the row max), target (top_p times the top-k
    survivors' mass): [rows] float32; part_max: [rows, tiles], each tile's max of z; logits:
    where given, the rows whose z is their logits are read there (z does not hold them).
    Decides and records the open rows' tokens (pending is left as scratch)."""
    rows, vocab = z.shape
    tiles = part_max.shape[1]
    programs = max(1, min(PROGRAMS, rows * tiles))
    mass = torch.empty(rows, tiles, dtype=torch.float32, device=z.device)
    gval = torch.empty(rows, tiles, dtype=torch.float32, device=z.device)
    gidx = torch.empty(rows, tiles, dtype=torch.int32, device=z.device)
    count = zeroed_counters(z.device, rows, "nucleus draw rows")
    pdl = pdl_available(z.device)
    states = (pending, torch.empty_like(pending))
    for r in range(ROUNDS):
        _round_kernel[(programs,)](
            z, vocab, tiles, rows, part_max, states[r % 2], states[(r + 1) % 2], tokens, bound,
            tau, m, target, slots, state.iparams, state.out_pos, state.counts, state.maybe_seen,
            mass, gval, gidx, count, z if logits is None else logits,
            vocab if logits is None else logits.stride(0), state.fparams,
            FINAL=r == ROUNDS - 1, BLOCK=tile, ROWS=triton.next_power_of_2(rows),
            TILES=triton.next_power_of_2(tiles), NUM_PROGRAMS=programs,
            PLAIN_FROM_LOGITS=logits is not None, PDL=pdl, launch_pdl=pdl, num_warps=4,
        )  # fmt: skip
