"""Pieces every Triton draw of the sampler shares: the counter-based Gumbel noise (bit for
bit runtime/sampling/noise.py's), the first-max reduction over tile partials, and recording
a row's token as its slot's output, and which rows' processed logits are their logits."""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from nanoqwen.kernels import sampling_layout as layout

# The interpreter has no libdevice: there the estimate takes the exact logs (the draw's
# logic, its fallback included, is the same).
FAST_LOGS = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")
LN2 = tl.constexpr(0.6931471805599453)

F_TEMPERATURE = tl.constexpr(layout.F_TEMPERATURE)
FLAG_PENALTY = tl.constexpr(layout.FLAG_PENALTY)
FLAG_BAN = tl.constexpr(layout.FLAG_BAN)
I_FLAGS = tl.constexpr(layout.I_FLAGS)


@triton.jit
def _mix64(x):
    x = x ^ (x >> 30)
    x = x * 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27)
    x = x * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D).to(tl.uint32)  # (uint32 products wrap as lowbias32's do)
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B).to(tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _noise_bits(seed, pos, offs):
    """23 random bits for tokens offs of a request at output position pos: a 64-bit key per
    (seed, position), then a 32-bit hash per token (a third of the 64-bit one's integer
    work, which a flat row pays over its whole vocabulary)."""
    key = _mix64(seed.to(tl.uint64, bitcast=True) + pos.to(tl.uint64) * 0x9E3779B97F4A7C15)
    key32 = (key ^ (key >> 32)).to(tl.uint32)
    bits = _mix32((key32 + ((offs + 1).to(tl.uint32) * 0x9E3779B9).to(tl.uint32)).to(tl.uint32))
    return bits >> 9


@triton.jit
def gumbel(seed, pos, offs):
    """Gumbel(0, 1) noise for tokens offs of a request at output position pos."""
    u = (_noise_bits(seed, pos, offs).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _log(x):
    if FAST_LOGS:
        return libdevice.fast_log2f(x) * LN2
    else:
        return tl.log(x)


@triton.jit
def _gumbel_estimate(k):
    """gumbel's noise for 23 bits k, within 1e-5, at a third of its arithmetic (fast logs).
    Where u = (k + 0.5) / 2^23 is near 1, -log(u) comes from its series in w = 1 - u (exact
    in float32): the fast log's absolute error would swamp it there."""
    u = (k.to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    w = ((8388607 - k).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    series = w * (1.0 + w * (0.5 + w * (1.0 / 3.0 + w * 0.25)))  # rel. error < w^4 / 5
    e = tl.where(w < 0.0625, series, -_log(u))
    return -_log(e)


@triton.jit
def gumbel_max(x, keep, seed, pos, offs):
    """(max, first index of it) over the tile of x + gumbel(seed, pos, offs) where keep (else
    -inf), bit for bit, at the cost of the estimate: the lanes whose estimated score lies
    within a bound of the estimated best are the only ones that can hold the exact best;
    where that is one lane (nearly always) its exact score is all that is computed, else
    every lane's is."""
    valid = keep & (x > float("-inf"))
    guess = tl.where(valid, x + _gumbel_estimate(_noise_bits(seed, pos, offs)), float("-inf"))
    top = tl.max(guess, axis=0)
    # The estimate's own error (1e-5) and each sum's rounding (half an ulp of the score);
    # the bound takes 100 times that.
    slack = 1e-3 + tl.abs(top) * (1.0 / 1048576.0)
    close = tl.sum((guess >= top - slack).to(tl.int32), axis=0)
    lane = tl.argmax(guess, axis=0)
    if (close == 1) & (top > float("-inf")):
        at = tl.arange(0, x.shape[0]) == lane
        token = tl.sum(tl.where(at, offs, 0), axis=0)
        best = tl.sum(tl.where(at, x, 0.0), axis=0) + gumbel(seed, pos, token)
    else:
        score = tl.where(valid, x + gumbel(seed, pos, offs), float("-inf"))
        best = tl.max(score, axis=0)
        lane = tl.argmax(score, axis=0)
    return best, lane


@triton.jit
def z_is_logits(fp, ip):
    """Whether the processed logits z of a slot (its fparams and iparams rows at fp, ip) are
    its logits bit for bit: temperature 1 (x / 1 is exact), no penalties, no bans. A pass
    that only reads z can read such a row's logits, and the pass before need not write it."""
    plain = (tl.load(ip + I_FLAGS) & (FLAG_PENALTY | FLAG_BAN)) == 0
    return plain & (tl.load(fp + F_TEMPERATURE) == 1.0)


@triton.jit
def first_max(values, payload, idx, n):
    """The payload at the first position holding the max of values (positions < n)."""
    best = tl.max(values, axis=0)
    first = tl.min(tl.where((values == best) & (idx < n), idx, n), axis=0)
    return best, tl.sum(tl.where(idx == first, payload, 0), axis=0)


@triton.jit
def in_vocab(token, vocab):
    """A NaN logit makes an argmax's index unspecified: a token indexes the counts and the
    next step's embedding, so it is kept inside the vocabulary."""
    return tl.minimum(tl.maximum(token, 0), vocab - 1)


@triton.jit
def record_token(token, row, slot, tokens_ptr, counts_ptr, maybe_seen_ptr, out_pos_ptr, vocab):
    """Stores the row's token and counts it as its slot's next output (penalties, positions),
    its bit set in the slot's maybe_seen (SamplingState.maybe_seen)."""
    token = in_vocab(token, vocab)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.atomic_add(counts_ptr + slot * vocab + token, 1)
    word = maybe_seen_ptr + slot * ((vocab + 31) // 32) + (token >> 5)
    tl.atomic_or(word, (1 << (token & 31)).to(tl.int32))
    tl.atomic_add(out_pos_ptr + slot, 1)


@triton.jit
def maybe_seen(maybe_seen_ptr, slot, first, vocab, BLOCK: tl.constexpr):
    """Per token of first + arange(BLOCK) (first a multiple of 32): whether it may be in the
    slot's prompt or outputs (its bit in SamplingState.maybe_seen); where not, its count is 0
    and its prompt mask clear. A word a 32 tokens, loaded once: the [words, 32] bits flatten
    to the tile's own layout."""
    tl.static_assert(BLOCK % 32 == 0, "a tile holds whole 32-token words")
    w = first // 32 + tl.arange(0, BLOCK // 32)
    words = tl.load(maybe_seen_ptr + slot * ((vocab + 31) // 32) + w, mask=w * 32 < vocab,
                    other=0)  # fmt: skip
    bits = (words[:, None] >> tl.arange(0, 32)[None, :]) & 1
    offs = first + tl.arange(0, BLOCK)
    return (tl.reshape(bits, (BLOCK,)) != 0) & (offs < vocab)
