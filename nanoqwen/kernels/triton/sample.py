"""Triton passes of the device-resident sampler (runtime/sampling/sampler.py).

Each row of a batch belongs to a slot of the SamplingState, whose tables hold the request's
settings and token statistics; kernels gather them by slot, so a step needs no per-row host
data besides the slot ids. Every pass runs over [rows, vocabulary tiles], so batch 1 still
spreads over many programs.

The noise is counter-based: token t of a request at output position n draws
hash(seed, n, t) (kernels/triton/draw.py), identical to runtime/sampling/noise.py, so a
seeded request samples the same tokens in any batch and on CPU or GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from nanoqwen.kernels import sampling_layout as layout
from nanoqwen.kernels.triton.counters import last_to_arrive, zeroed_counters
from nanoqwen.kernels.triton.draw import (
    first_max,
    gumbel_max,
    in_vocab,
    maybe_seen,
    record_token,
    z_is_logits,
)
from nanoqwen.kernels.triton.nucleus_draw import draw_open_rows
from nanoqwen.kernels.triton.pdl import use_pdl
from nanoqwen.kernels.triton.sampling_thresholds import thresholds

TILE = 2048  # vocabulary entries per program

# Which rows the first pass draws for (its SAMPLE): none; every row (no filter in the batch);
# the rows no filter threshold can cut (no top-k, no min-p: a top-p alone is decided after
# the draw, nucleus_draw.py), whose draw then needs no second pass over z; every row of a
# batch that no threshold cuts, its top-p rows left open for nucleus_draw.py.
DRAW_NONE, DRAW_ALL, DRAW_UNCUT, DRAW_NUCLEUS = 0, 1, 2, 3
_ALL, _UNCUT = tl.constexpr(DRAW_ALL), tl.constexpr(DRAW_UNCUT)
_NUCLEUS = tl.constexpr(DRAW_NUCLEUS)

# The tables' layout (sampling_layout.py) as compile-time constants.
F_TEMPERATURE = tl.constexpr(layout.F_TEMPERATURE)
F_TOP_P = tl.constexpr(layout.F_TOP_P)
F_REPETITION = tl.constexpr(layout.F_REPETITION)
F_PRESENCE = tl.constexpr(layout.F_PRESENCE)
F_FREQUENCY = tl.constexpr(layout.F_FREQUENCY)
NUM_F = tl.constexpr(layout.NUM_F)
F_MIN_P = tl.constexpr(layout.F_MIN_P)
I_TOP_K = tl.constexpr(layout.I_TOP_K)
I_MIN_TOKENS = tl.constexpr(layout.I_MIN_TOKENS)
I_SEED = tl.constexpr(layout.I_SEED)
I_FLAGS = tl.constexpr(layout.I_FLAGS)
NUM_I = tl.constexpr(layout.NUM_I)
FLAG_GREEDY = tl.constexpr(layout.FLAG_GREEDY)
FLAG_PENALTY = tl.constexpr(layout.FLAG_PENALTY)
FLAG_BAN = tl.constexpr(layout.FLAG_BAN)


@triton.jit
def _prepare_kernel(
    logits_ptr, logits_stride, z_ptr, slots_ptr, fparams_ptr, iparams_ptr, out_pos_ptr,
    prompt_mask_ptr, counts_ptr, maybe_seen_ptr, ban_mask_ptr,
    part_max_ptr, part_sum_ptr, part_arg_ptr, part_gval_ptr, part_gidx_ptr,
    vocab, num_tiles, m_ptr, s_ptr, greedy_ptr, bound_ptr, tokens_ptr, row_count_ptr,
    pending_ptr, target_ptr,
    WRITE_Z: tl.constexpr, PLAIN_Z: tl.constexpr, SAMPLE: tl.constexpr,
    DRAW_EVERY_ROW: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr,
    CANDIDATES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Penalties, min_tokens bans and temperature in one pass (the processed logits z), with
    per-tile partials: max, sum of exp(z - max), first argmax; for the rows SAMPLE names
    (DRAW_*) the Gumbel argmax of z + noise (a draw with no filter threshold). The row's last
    tile program to finish reduces the row (_reduce_row: FIRST, and with DRAW_ALL the draw and
    its record; with DRAW_NUCLEUS a top-p row's draw is left open instead). Without PLAIN_Z,
    z is not written for rows whose z is their logits (draw.z_is_logits)."""
    if PDL:  # launched behind the lm_head: everything here reads or follows its logits
        gdc_wait()
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
        # The two tables are read only where a token may be seen: a few hundred tokens of a
        # row, so the pass streams the logits alone (their 5 bytes a token would double it).
        maybe = maybe_seen(maybe_seen_ptr, slot, tile * BLOCK, vocab, BLOCK)
        counts = tl.load(counts_ptr + table, mask=maybe, other=0)
        seen = (tl.load(prompt_mask_ptr + table, mask=maybe, other=0) != 0) | (counts > 0)
        rep = tl.load(fp + F_REPETITION)
        x = tl.where(seen, tl.where(x < 0, x * rep, x / rep), x)
        x = x - tl.load(fp + F_FREQUENCY) * counts.to(tl.float32)
        x = x - tl.load(fp + F_PRESENCE) * (counts > 0).to(tl.float32)
    ban_active = tl.load(out_pos_ptr + slot) < tl.load(ip + I_MIN_TOKENS)
    if ((flags & FLAG_BAN) != 0) & ban_active:
        banned = tl.load(ban_mask_ptr + table, mask=inside, other=0) != 0
        x = tl.where(banned, float("-inf"), x)
    x = x / tl.load(fp + F_TEMPERATURE)
    if WRITE_Z:  # noqa: SIM102 (a compile-time guard: Triton's `and` would not be)
        if PLAIN_Z or not z_is_logits(fp, ip):
            tl.store(z_ptr + row * vocab + offs, x, mask=inside)
    part = row * num_tiles + tile
    tile_max = tl.max(x, axis=0)
    tl.store(part_max_ptr + part, tile_max)
    total = tl.sum(tl.exp(x - tile_max), axis=0)
    tl.store(part_sum_ptr + part, tl.where(tile_max == float("-inf"), 0.0, total))
    tl.store(part_arg_ptr + part, tile * BLOCK + tl.argmax(x, axis=0))
    if DRAW_EVERY_ROW:
        _store_draw(x, inside, flags, ip, out_pos_ptr, slot, offs, part, tile * BLOCK,
                    part_gval_ptr, part_gidx_ptr)  # fmt: skip
    elif SAMPLE == _UNCUT:  # noqa: SIM102 (a compile-time guard: Triton's `and` would not be)
        if not _cut(fp, ip, vocab):
            _store_draw(x, inside, flags, ip, out_pos_ptr, slot, offs, part, tile * BLOCK,
                        part_gval_ptr, part_gidx_ptr)  # fmt: skip
    if last_to_arrive(row_count_ptr + row, num_tiles):
        open_row = False
        if SAMPLE == _NUCLEUS:
            open_row = tl.load(fp + F_TOP_P) < 1.0  # (greedy rows hold 1)
            tl.store(pending_ptr + row, open_row.to(tl.int32))
        s = _reduce_row(
            row, part_max_ptr, part_sum_ptr, part_arg_ptr, part_gval_ptr, part_gidx_ptr,
            num_tiles, m_ptr, s_ptr, greedy_ptr, bound_ptr, tokens_ptr, slots_ptr,
            iparams_ptr, counts_ptr, maybe_seen_ptr, out_pos_ptr, open_row, vocab, True,
            DRAW_EVERY_ROW, DRAW_EVERY_ROW, TILES, CANDIDATES,
        )  # fmt: skip
        if SAMPLE == _NUCLEUS:
            # nucleus_draw.py's inputs: no threshold below top-p's (bound -inf, read as both
            # its bound and its tau), and the mass top-p keeps of the row's.
            tl.store(bound_ptr + row, float("-inf"))
            tl.store(target_ptr + row, tl.load(fp + F_TOP_P) * s)


@triton.jit
def _cut(fp, ip, vocab):
    """Whether a filter threshold may cut the row (top-k or min-p; greedy rows draw none)."""
    return (tl.load(ip + I_TOP_K) < vocab) | (tl.load(fp + F_MIN_P) > 0)


@triton.jit
def _store_draw(x, keep, flags, ip, out_pos_ptr, slot, offs, part, first, gval_ptr, gidx_ptr):
    """The tile's Gumbel-max candidate among `keep` (none for greedy rows)."""
    if (flags & FLAG_GREEDY) == 0:
        best, lane = gumbel_max(x, keep, tl.load(ip + I_SEED), tl.load(out_pos_ptr + slot), offs)
        tl.store(gval_ptr + part, best)
        tl.store(gidx_ptr + part, first + lane)
    else:
        tl.store(gval_ptr + part, float("-inf"))
        tl.store(gidx_ptr + part, first)


@triton.jit
def _sample_kernel(
    z_ptr, tau_ptr, part_max_ptr, slots_ptr, fparams_ptr, iparams_ptr, out_pos_ptr,
    part_gval_ptr, part_gidx_ptr, vocab, num_tiles, greedy_ptr, tokens_ptr, counts_ptr,
    maybe_seen_ptr, pending_ptr, row_count_ptr, BLOCK: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """Gumbel-max partials over the tokens with z >= tau (the row's filter threshold), for
    the rows a filter threshold can cut (the first pass drew the others, DRAW_UNCUT); the
    row's last tile program to finish draws and records its token (a row still open for
    nucleus_draw.py gets its draw as that pass's first candidate)."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    part = row * num_tiles + tile
    tau = tl.load(tau_ptr + row)
    if not _cut(fparams_ptr + slot * NUM_F, iparams_ptr + slot * NUM_I, vocab):
        pass  # its partials are the first pass's draw
    elif tl.load(part_max_ptr + part) < tau:  # the filters keep nothing here: most tiles
        tl.store(part_gval_ptr + part, float("-inf"))
        tl.store(part_gidx_ptr + part, tile * BLOCK)
    else:
        ip = iparams_ptr + slot * NUM_I
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        inside = offs < vocab
        x = tl.load(z_ptr + row * vocab + offs, mask=inside, other=float("-inf"))
        keep = inside & (x >= tau)
        _store_draw(x, keep, tl.load(ip + I_FLAGS), ip, out_pos_ptr, slot, offs, part,
                    tile * BLOCK, part_gval_ptr, part_gidx_ptr)  # fmt: skip
    if last_to_arrive(row_count_ptr + row, num_tiles):
        _reduce_row(
            row, part_max_ptr, part_max_ptr, part_max_ptr, part_gval_ptr, part_gidx_ptr,
            num_tiles, part_max_ptr, part_max_ptr, greedy_ptr, part_max_ptr, tokens_ptr,
            slots_ptr, iparams_ptr, counts_ptr, maybe_seen_ptr, out_pos_ptr,
            tl.load(pending_ptr + row) != 0, vocab, False, True, True, TILES, 0,
        )  # fmt: skip


@triton.jit
def _reduce_row(
    row, part_max_ptr, part_sum_ptr, part_arg_ptr, part_gval_ptr, part_gidx_ptr, num_tiles,
    m_ptr, s_ptr, greedy_ptr, bound_ptr, tokens_ptr, slots_ptr, iparams_ptr, counts_ptr,
    maybe_seen_ptr, out_pos_ptr, open_row, vocab,
    FIRST: tl.constexpr, SAMPLED: tl.constexpr, RECORD: tl.constexpr, TILES: tl.constexpr,
    CANDIDATES: tl.constexpr,
):  # fmt: skip
    """One row, over its tile partials (stored by other programs of this launch: the loads
    skip L1): FIRST: max, sum of exp and greedy token, and with CANDIDATES the row's bound
    for them (sampling_thresholds._candidates_kernel); SAMPLED: the draw; RECORD: the row's
    token (greedy or drawn) stored and counted as the slot's output, except where open_row
    (its top-p boundary still open): its draw is stored as the first candidate of
    nucleus_draw.py, which records the row's token. Returns FIRST's sum of exp (else 0)."""
    idx = tl.arange(0, TILES)
    parts = row * num_tiles + idx
    inside = idx < num_tiles
    token = tl.zeros((), tl.int32)
    s = tl.zeros((), tl.float32)
    if FIRST:
        pmax = tl.load(part_max_ptr + parts, mask=inside, other=float("-inf"),
                       cache_modifier=".cg")  # fmt: skip
        arg = tl.load(part_arg_ptr + parts, mask=inside, other=0, cache_modifier=".cg")
        m, greedy = first_max(pmax, arg, idx, num_tiles)
        psum = tl.load(part_sum_ptr + parts, mask=inside, other=0.0, cache_modifier=".cg")
        tl.store(m_ptr + row, m)
        s = tl.sum(psum * tl.exp(pmax - m), axis=0)
        tl.store(s_ptr + row, s)
        tl.store(greedy_ptr + row, greedy)
        token = greedy
        if CANDIDATES > 0:
            # With top-k k of at most CANDIDATES, the k-th largest tile max: the row's k
            # largest values are at or above it (k tiles have a value there), and its
            # filters read no other. Else none: a top-p nucleus may reach into every tile.
            # Greedy rows read no candidate.
            ip = iparams_ptr + tl.load(slots_ptr + row) * NUM_I
            top_k = tl.load(ip + I_TOP_K)
            kth = tl.where(idx == top_k - 1, tl.sort(pmax, descending=True), 0.0)
            bound = tl.where(top_k <= CANDIDATES, tl.sum(kth, axis=0), float("-inf"))
            greedy_row = (tl.load(ip + I_FLAGS) & FLAG_GREEDY) != 0
            tl.store(bound_ptr + row, tl.where(greedy_row, float("inf"), bound))
    if RECORD:
        slot = tl.load(slots_ptr + row)
        if not FIRST:
            token = tl.load(greedy_ptr + row)  # the prepare launch's
        if SAMPLED:
            gval = tl.load(part_gval_ptr + parts, mask=inside, other=float("-inf"),
                           cache_modifier=".cg")  # fmt: skip
            gidx = tl.load(part_gidx_ptr + parts, mask=inside, other=0, cache_modifier=".cg")
            _, drawn = first_max(gval, gidx, idx, num_tiles)
            greedy_row = (tl.load(iparams_ptr + slot * NUM_I + I_FLAGS) & FLAG_GREEDY) != 0
            token = tl.where(greedy_row, token, drawn)
        if open_row:
            tl.store(tokens_ptr + row, in_vocab(token, vocab).to(tl.int64))
        else:
            record_token(token, row, slot, tokens_ptr, counts_ptr, maybe_seen_ptr, out_pos_ptr,
                         vocab)  # fmt: skip
    return s


class _Partials:
    def __init__(self, rows: int, vocab: int, device, candidates: int = 0) -> None:
        self.tile = TILE  # vocabulary entries per tile (a test sets smaller ones)
        self.tiles = triton.cdiv(vocab, TILE)
        f32 = dict(dtype=torch.float32, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        shape = (rows, self.tiles)
        self.max, self.sum, self.gval = (torch.empty(shape, **f32) for _ in range(3))
        self.arg, self.gidx = torch.empty(shape, **i32), torch.empty(shape, **i32)
        self.cand = torch.empty(rows, self.tiles, max(candidates, 1), **f32)
        self.floor = torch.empty(shape, **f32)  # every value above it is a candidate
        self.count = torch.empty(shape, **i32)  # how many of its candidates were stored
        self.m, self.s = torch.empty(rows, **f32), torch.empty(rows, **f32)
        self.bound = torch.empty(rows, **f32)
        self.greedy = torch.empty(rows, **i32)


def _prepare(
    logits, slots, state, z, parts: _Partials, sample: int, tokens=None, candidates: int = 0,
    open_rows=None, plain_z: bool = True,
) -> None:  # fmt: skip
    """The prepare pass, each row then reduced by its last tile program: FIRST (the row's
    max, sum, greedy token and, with candidates, their bound), and with DRAW_ALL the draw
    and its record into tokens; with DRAW_NUCLEUS, open_rows (pending, target) are written
    too (the bound into parts.bound). plain_z False: z holds only the rows whose z is not
    their logits (draw.z_is_logits)."""
    rows, vocab = logits.shape
    pending, target = (parts.greedy, parts.s) if open_rows is None else open_rows
    pdl = use_pdl(logits)
    _prepare_kernel[(rows, parts.tiles)](
        logits, logits.stride(0), logits if z is None else z, slots, state.fparams,
        state.iparams, state.out_pos, state.prompt_mask, state.counts, state.maybe_seen,
        state.ban_mask,
        parts.max, parts.sum, parts.arg, parts.gval, parts.gidx, vocab, parts.tiles, parts.m,
        parts.s, parts.greedy, parts.bound, parts.m if tokens is None else tokens,
        zeroed_counters(logits.device, rows, "sampler prepare rows"), pending, target,
        WRITE_Z=z is not None, PLAIN_Z=plain_z, SAMPLE=sample,
        DRAW_EVERY_ROW=sample in (DRAW_ALL, DRAW_NUCLEUS), BLOCK=parts.tile,
        TILES=triton.next_power_of_2(parts.tiles), CANDIDATES=candidates, PDL=pdl,
        launch_pdl=pdl, num_warps=4,
    )  # fmt: skip


def plain_step(logits: torch.Tensor, slots: torch.Tensor, state) -> torch.Tensor:
    """Tokens for rows without top-k/top-p/min-p: one pass over the logits, one reduction."""
    rows, vocab = logits.shape
    parts = _Partials(rows, vocab, logits.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _prepare(logits, slots, state, None, parts, sample=DRAW_ALL, tokens=tokens)
    return tokens


def filter_thresholds(
    logits: torch.Tensor, slots: torch.Tensor, state, candidates: int, exact: bool = True,
    draw: int = DRAW_NONE,
):  # fmt: skip
    """The processed logits z, each row's threshold tau (top-k, top-p and min-p keep
    z >= tau), the partials (with the draws of the rows `draw` names) and the rows left open
    (sampling_thresholds.thresholds; with exact, none)."""
    rows, vocab = logits.shape
    parts = _Partials(rows, vocab, logits.device, candidates)
    z = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    _prepare(logits, slots, state, z, parts, sample=draw, candidates=candidates)
    tau, open_rows = thresholds(z, parts, slots, state, candidates, exact)
    return z, tau, parts, open_rows


def filter_step(logits: torch.Tensor, slots: torch.Tensor, state, candidates: int):
    """Tokens with top-k/top-p/min-p: thresholds from the candidates, then a draw over z; rows
    whose top-p boundary lies below every candidate are drawn without it (nucleus_draw.py)."""
    z, tau, parts, open_rows = filter_thresholds(
        logits, slots, state, candidates, exact=False, draw=DRAW_UNCUT
    )
    rows, vocab = z.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=z.device)
    _sample_kernel[(rows, parts.tiles)](
        z, tau, parts.max, slots, state.fparams, state.iparams, state.out_pos, parts.gval,
        parts.gidx, vocab, parts.tiles, parts.greedy, tokens, state.counts, state.maybe_seen,
        open_rows.pending,
        zeroed_counters(z.device, rows, "sampler draw rows"), BLOCK=parts.tile,
        TILES=triton.next_power_of_2(parts.tiles), num_warps=4,
    )  # fmt: skip
    draw_open_rows(z, tokens, open_rows.pending, open_rows.bound, tau, parts.m,
                   open_rows.target, slots, state, parts.max, parts.tile)  # fmt: skip
    return tokens


def nucleus_step(logits: torch.Tensor, slots: torch.Tensor, state) -> torch.Tensor:
    """Tokens for a batch whose filtering rows use top-p alone (no top-k, no min-p): the first
    pass draws every row, records the rows without top-p and leaves each top-p row's draw as
    the first candidate of nucleus_draw.py, with no candidates, thresholds or second draw."""
    rows, vocab = logits.shape
    device = logits.device
    parts = _Partials(rows, vocab, device)
    z = torch.empty(rows, vocab, dtype=torch.float32, device=device)
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    pending = torch.empty(rows, dtype=torch.int32, device=device)
    target = torch.empty(rows, dtype=torch.float32, device=device)
    # The rounds read a row whose z is its logits there: at temperature 1 (what OpenAI
    # clients send by default) z is not written at all.
    _prepare(logits, slots, state, z, parts, sample=DRAW_NUCLEUS, tokens=tokens,
             open_rows=(pending, target), plain_z=False)  # fmt: skip
    draw_open_rows(z, tokens, pending, parts.bound, parts.bound, parts.m, target, slots, state,
                   parts.max, parts.tile, logits=logits)  # fmt: skip
    return tokens
