"""Low-latency all-reduce for small messages (a decode step's): every rank writes its message
straight into every rank's buffer as 64-bit packets, 32 bits of data beside a 32-bit flag
that names the call, and then reads only its own buffer until every packet of the call has
come. A packet's data and flag arrive together (one aligned 8-byte write), so no fence,
no separate flag and no read across the link is needed: one link crossing a call, against
all_reduce.py's three (the release of a flag, its observation, the read of the peer's copy).
The price is twice the bytes on the link, which is why larger messages take all_reduce.py.

Memory layout, per rank: ll: int64 [2 parities, G_MAX programs, WORLD sources, REGION]:
program j of rank r writes its packets into region (parity, j, r) of every rank. Epochs and
verdict words are per program, in the state words given (runtime/parallel/
custom_all_reduce.py); the failed word is all_reduce.py's, shared. The same reuse argument as
all_reduce.py's holds: a region of parity e % 2 is rewritten in epoch e only after the
writer's previous call waited for every rank's epoch e - 1 packets, which each rank sends
only after its epoch e - 2 reads of that region are done.

Flags are never 0 (the buffers start zeroed): epoch e writes ((e - 1) mod (2^32 - 1)) + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from nanoqwen.kernels.triton.all_reduce import (
    INTERPRETED,
    NUM_WARPS,
    give_up_verdict,
    grid_and_chunk,
)

BLOCK = 512  # 32-bit words (packets) per program per pass
LOW = tl.constexpr(0xFFFFFFFF)  # a packet's data word
HIGH = tl.constexpr(-(1 << 32))  # its flag word (0xFFFFFFFF00000000 as an int64)
# How the 32-bit words hold the message: float32 itself, or two bfloat16 / float16 halves.
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def halves(w, KIND: tl.constexpr):
    """The two 16-bit floats of each word, in float32 (KIND 0: the word's float32, and 0)."""
    if KIND == 0:
        a = w.to(tl.float32, bitcast=True)
        b = tl.zeros(w.shape, tl.float32)
    else:
        half = tl.bfloat16 if KIND == 1 else tl.float16
        a = (w & 0xFFFF).to(tl.int16).to(half, bitcast=True).to(tl.float32)
        b = (w >> 16).to(tl.int16).to(half, bitcast=True).to(tl.float32)
    return a, b


@triton.jit
def to_word(lo, hi, KIND: tl.constexpr):
    """The inverse of halves, rounding each float32 once to the message's dtype."""
    if KIND == 0:
        w = lo.to(tl.int32, bitcast=True)
    else:
        half = tl.bfloat16 if KIND == 1 else tl.float16
        lo16 = lo.to(half).to(tl.int16, bitcast=True).to(tl.int32)
        hi16 = hi.to(half).to(tl.int16, bitcast=True).to(tl.int32)
        w = (hi16 << 16) | (lo16 & 0xFFFF)
    return w


@triton.jit
def begin_call(state_ptr, failed_ptr, G_MAX: tl.constexpr, WORLD: tl.constexpr):
    """This program's call: (flag its packets carry, its region base, failed word, verdict
    word). Scalar atomics: one thread's result, broadcast to every warp (all_reduce.py says
    why)."""
    pid = tl.program_id(0)
    epoch = tl.atomic_add(state_ptr + pid, 1, sem="relaxed", scope="gpu") + 1
    failed = tl.atomic_add(failed_ptr, 0, sem="relaxed", scope="gpu").to(tl.int32)
    flag = ((epoch - 1) % LOW + 1) << 32
    base = ((epoch % 2) * G_MAX + pid) * WORLD
    return flag, base, failed, state_ptr + G_MAX + pid


@triton.jit
def send_packets(words_ptr, idx, mask, flag, base, ptrs_ptr, rank, WORLD: tl.constexpr, REGION):
    """This rank's words at words_ptr + idx, as packets into slot idx of every rank's region."""
    packet = (tl.load(words_ptr + idx, mask=mask).to(tl.int64) & LOW) | flag
    for q in tl.static_range(WORLD):
        dst = tl.load(ptrs_ptr + q).to(tl.pointer_type(tl.int64)) + (base + rank) * REGION
        tl.atomic_xchg(dst + idx, packet, mask=mask, sem="relaxed", scope="sys")


@triton.jit
def send_chunk(
    x_ptr, n, chunk, flag, base, ptrs_ptr, rank, WORLD: tl.constexpr, REGION, BLOCK: tl.constexpr
):  # fmt: skip
    """Sends this program's chunk of the n words at x_ptr; returns the chunk's start."""
    start = tl.program_id(0).to(tl.int64) * chunk
    for off in range(0, chunk, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        send_packets(x_ptr + start, idx, start + idx < n, flag, base, ptrs_ptr, rank, WORLD, REGION)
    return start


@triton.jit
def wait_packets(
    src, mask, flag, gave_up, spins, t0, status, verdict, timeout, USE_CLOCK: tl.constexpr
):  # fmt: skip
    """The packets at src once each carries flag, or once the wait gives up:
    (packets, gave_up, spins)."""
    p = tl.load(src, mask=mask, other=0, volatile=True)
    missing = tl.sum((((p & HIGH) != flag) & mask).to(tl.int32), axis=0)
    while (missing > 0) & (gave_up == 0):
        p = tl.load(src, mask=mask, other=0, volatile=True)
        missing = tl.sum((((p & HIGH) != flag) & mask).to(tl.int32), axis=0)
        spins += 1
        if spins % 64 == 0:
            gave_up = give_up_verdict(status, verdict, spins, t0, timeout, USE_CLOCK)
    return p, gave_up, spins


@triton.jit
def receive_sums(
    idx, mask, flag, base, ptrs_ptr, rank, gave_up, spins, t0, verdict, timeout,
    WORLD: tl.constexpr, REGION, KIND: tl.constexpr, USE_CLOCK: tl.constexpr,
):  # fmt: skip
    """Waits for every rank's packets at slot idx of this rank's region and sums them in
    float32, in the same rank order on every rank (so every rank gets bitwise the same sums):
    (sums of the low and high halves of the words, gave_up, spins)."""
    mine = tl.load(ptrs_ptr + rank).to(tl.pointer_type(tl.int64))
    status = tl.load(ptrs_ptr + WORLD).to(tl.pointer_type(tl.int32))
    lo = tl.zeros(idx.shape, dtype=tl.float32)
    hi = tl.zeros(idx.shape, dtype=tl.float32)
    for q in tl.static_range(WORLD):
        p, gave_up, spins = wait_packets(
            mine + (base + q) * REGION + idx, mask, flag, gave_up, spins, t0, status, verdict,
            timeout, USE_CLOCK,
        )  # fmt: skip
        a, b = halves((p & LOW).to(tl.int32), KIND)
        lo += a
        hi += b
    return lo, hi, gave_up, spins


@triton.jit
def end_call(gave_up, failed, failed_ptr, ptrs_ptr, WORLD: tl.constexpr):
    if gave_up != failed:
        status = tl.load(ptrs_ptr + WORLD).to(tl.pointer_type(tl.int32))
        tl.store(status + 1, gave_up.to(tl.int32))  # status[1] (ERROR), read by the host
        tl.store(failed_ptr, gave_up)


@triton.jit
def _ll_all_reduce_kernel(
    x_ptr, n, chunk, ptrs_ptr, state_ptr, failed_ptr, rank, timeout,
    WORLD: tl.constexpr, G_MAX: tl.constexpr, REGION: tl.constexpr, BLOCK: tl.constexpr,
    KIND: tl.constexpr, USE_CLOCK: tl.constexpr,
):  # fmt: skip
    flag, base, failed, verdict = begin_call(state_ptr, failed_ptr, G_MAX, WORLD)
    start = send_chunk(x_ptr, n, chunk, flag, base, ptrs_ptr, rank, WORLD, REGION, BLOCK)
    gave_up = failed  # a rank that gave up once no longer waits: its results are void anyway
    spins = tl.full([], 0, tl.int32)  # a tensor, as receive_sums's loop carries it
    t0 = globaltimer() if USE_CLOCK else 0
    for off in range(0, chunk, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        mask = start + idx < n
        lo, hi, gave_up, spins = receive_sums(
            idx, mask, flag, base, ptrs_ptr, rank, gave_up, spins, t0, verdict, timeout,
            WORLD, REGION, KIND, USE_CLOCK,
        )  # fmt: skip
        tl.store(x_ptr + start + idx, to_word(lo, hi, KIND), mask=mask)
    end_call(gave_up, failed, failed_ptr, ptrs_ptr, WORLD)


@triton.jit
def _ll_all_gather_kernel(
    x_ptr, out_ptr, n, chunk, ptrs_ptr, state_ptr, failed_ptr, rank, timeout,
    WORLD: tl.constexpr, G_MAX: tl.constexpr, REGION: tl.constexpr, BLOCK: tl.constexpr,
    SOURCE: tl.constexpr, USE_CLOCK: tl.constexpr,
):  # fmt: skip
    """The same packets and waits as _ll_all_reduce_kernel's, each rank's words stored at
    its place in out instead of summed; SOURCE >= 0: only that rank's words, stored at the
    start of out (a broadcast; every rank still sends and waits, as the protocol needs)."""
    flag, base, failed, verdict = begin_call(state_ptr, failed_ptr, G_MAX, WORLD)
    start = send_chunk(x_ptr, n, chunk, flag, base, ptrs_ptr, rank, WORLD, REGION, BLOCK)
    mine = tl.load(ptrs_ptr + rank).to(tl.pointer_type(tl.int64))
    status = tl.load(ptrs_ptr + WORLD).to(tl.pointer_type(tl.int32))
    gave_up = failed
    spins = tl.full([], 0, tl.int32)
    t0 = globaltimer() if USE_CLOCK else 0
    for off in range(0, chunk, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        mask = start + idx < n
        for q in tl.static_range(WORLD):
            p, gave_up, spins = wait_packets(
                mine + (base + q) * REGION + idx, mask, flag, gave_up, spins, t0, status,
                verdict, timeout, USE_CLOCK,
            )  # fmt: skip
            if SOURCE < 0:
                tl.store(out_ptr + q * n + start + idx, (p & LOW).to(tl.int32), mask=mask)
            elif q == SOURCE:
                tl.store(out_ptr + start + idx, (p & LOW).to(tl.int32), mask=mask)
    end_call(gave_up, failed, failed_ptr, ptrs_ptr, WORLD)


def region_words(max_bytes: int, g_max: int) -> int:
    """Packets each (parity, program, source) region holds for messages up to max_bytes."""
    return max(1, triton.cdiv(triton.cdiv(max_bytes // 4, g_max), BLOCK)) * BLOCK


@dataclass(frozen=True)
class LowLatencyBuffers:
    """What every low-latency call of a rank passes its kernel. ptrs: int64 [world + 1] =
    every rank's ll buffer, this rank's pinned status words; state: int64 [2 * g_max] epochs
    and verdicts; failed: the failed word (shared with all_reduce.py's kernel); region:
    packets per (parity, program, source); timeout: ns on a GPU, spins in the interpreter."""

    ptrs: torch.Tensor
    state: torch.Tensor
    failed: torch.Tensor
    rank: int
    world: int
    g_max: int
    region: int
    timeout: int

    def launch(self, kernel, grid: tuple[int], *args, **constexprs) -> None:
        """kernel's own arguments, then the protocol's (its signature ends with them)."""
        kernel[grid](
            *args, self.ptrs, self.state, self.failed, self.rank, self.timeout,
            WORLD=self.world, G_MAX=self.g_max, REGION=self.region, USE_CLOCK=not INTERPRETED,
            **constexprs,
        )  # fmt: skip

    def chunked(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
        """x's 32-bit words, their count, the programs and the words each takes."""
        words = x.reshape(-1).view(torch.int32)
        n = words.numel()
        programs, chunk = grid_and_chunk(n, self.g_max, BLOCK)
        assert chunk <= self.region, (n, chunk, self.region)
        return words, n, programs, chunk


def ll_all_reduce(x: torch.Tensor, buffers: LowLatencyBuffers) -> None:
    """Sums x (contiguous, non-empty, a whole number of 4-byte words, 4-byte aligned, at most
    g_max * region words) over the ranks, in place."""
    words, n, programs, chunk = buffers.chunked(x)
    buffers.launch(
        _ll_all_reduce_kernel, (programs,), words, n, chunk, BLOCK=BLOCK, KIND=KINDS[x.dtype],
        num_warps=NUM_WARPS,
    )  # fmt: skip


def ll_all_gather(
    x: torch.Tensor, out: torch.Tensor, buffers: LowLatencyBuffers, source: int = -1
) -> None:
    """Every rank's x into out (contiguous, world times x's size: rank q's x at q's place),
    any dtype; x as ll_all_reduce takes it. source >= 0: only that rank's x, into out of x's
    size (which may be x itself: each program sends its words before it stores any)."""
    words, n, programs, chunk = buffers.chunked(x)
    buffers.launch(
        _ll_all_gather_kernel, (programs,), words, out.reshape(-1).view(torch.int32), n, chunk,
        BLOCK=BLOCK, SOURCE=source, num_warps=NUM_WARPS,
    )  # fmt: skip
