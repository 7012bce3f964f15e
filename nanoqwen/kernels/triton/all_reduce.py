"""One-shot all-reduce over peer-mapped buffers: every rank copies its input into its own
buffer, tells every peer so, waits to be told the same by each, and sums all the ranks'
buffers itself. One kernel launch, no NCCL, plain peer loads and stores (no multicast).

Memory layout, per rank (runtime/parallel/custom_all_reduce.py allocates and maps it):
- data: [2 parities, G_MAX programs, REGION elements]. Program j only ever writes, and the
  peers' program j only ever read, the region j of a parity, whatever the message size.
- flags: int64 [G_MAX, WORLD]; flags[j, q] is the last epoch rank q's program j announced
  to this rank. Peers write them (remote atomics); this rank polls its own.
- state (local only): int64 [2 * G_MAX + 1]: each program's epoch (how many calls it took
  part in, the same on every rank since every rank makes the same calls), a failed word, then
  each program's verdict word (how its wait loop's give-up decision reaches all its warps).

Every value that decides a branch around a barrier must be the same in all the warps of a
program (a warp that leaves the wait loop while another keeps spinning pairs their
bar.syncs wrongly: undefined, a hang that no timeout ends). Triton lowers a scalar atomic to
one thread's atomic whose result reaches every thread through shared memory after a barrier,
so the epoch, the failed word and the give-up verdict are read with scalar atomics, never
with per-thread loads (thread 0's store of the epoch raced with a late warp's load; each
thread read its own %globaltimer and the host's status word at its own time).

Why one wait per call is enough: a program writes its region of parity e % 2 in epoch e only
after its previous kernel ended, and that kernel waited for every peer's program j of epoch
e - 1, which each peer starts only after its kernel of epoch e - 2 (the last reader of this
region) has ended. A peer can so be one epoch ahead, never two: flags are compared with >=.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 1024  # elements per program per pass: 16-byte loads for bf16 with 4 warps
NUM_WARPS = 4


@triton.jit
def give_up_verdict(status, verdict, spins, t0, timeout, USE_CLOCK: tl.constexpr):
    """Whether a wait loop stops waiting: 0 (go on), 1 (TIMED_OUT) or 2 (ABORTED: the host
    set status[0], having given up on a peer). Thread 0 writes its view to the program's
    verdict word and reads it back, so every warp gets the same answer and leaves the loop
    in the same iteration. timeout: ns since t0 on a GPU, spins in the interpreter."""
    mine = 0
    if tl.load(status + 0, volatile=True) != 0:
        mine = 2
    if USE_CLOCK:
        if globaltimer() - t0 > timeout:
            mine = 1
    elif spins > timeout:
        mine = 1
    tl.atomic_xchg(verdict, mine.to(tl.int64), sem="relaxed", scope="gpu")
    return tl.atomic_add(verdict, 0, sem="relaxed", scope="gpu").to(tl.int32)


@triton.jit
def _one_shot_all_reduce_kernel(
    x_ptr, n, chunk, ptrs_ptr, state_ptr, rank, timeout,
    WORLD: tl.constexpr, WORLD_POW2: tl.constexpr, G_MAX: tl.constexpr,
    REGION: tl.constexpr, BLOCK: tl.constexpr, USE_CLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    # Scalar atomics: one thread's result, broadcast to every warp (see the docstring).
    epoch = tl.atomic_add(state_ptr + pid, 1, sem="relaxed", scope="gpu") + 1
    failed = tl.atomic_add(state_ptr + G_MAX, 0, sem="relaxed", scope="gpu").to(tl.int32)
    verdict = state_ptr + G_MAX + 1 + pid
    dtype = x_ptr.dtype.element_ty
    region = ((epoch % 2) * G_MAX + pid) * REGION
    start = pid.to(tl.int64) * chunk
    # Regions are 4 KiB aligned: the hint lets the copies and sums use 16-byte accesses.
    own = tl.multiple_of(tl.load(ptrs_ptr + rank).to(tl.pointer_type(dtype)) + region, 16)
    for off in range(0, chunk, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        mask = start + idx < n
        tl.store(own + idx, tl.load(x_ptr + start + idx, mask=mask), mask=mask)
    # Every thread's copy is done before the release below publishes it (PTX cumulativity:
    # the barrier orders the other threads' stores before the releasing thread's atomic).
    tl.debug_barrier()
    ranks = tl.arange(0, WORLD_POW2)
    live = ranks < WORLD
    peer_flags = tl.load(ptrs_ptr + WORLD + ranks, mask=live, other=0).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(peer_flags + pid * WORLD + rank, epoch, mask=live, sem="release", scope="sys")

    my_flags = tl.load(ptrs_ptr + WORLD + rank).to(tl.pointer_type(tl.int64)) + pid * WORLD
    seen = tl.atomic_add(my_flags + ranks, 0, mask=live, sem="acquire", scope="sys")
    waiting = tl.sum(((seen < epoch) & live).to(tl.int32), axis=0)
    status = tl.load(ptrs_ptr + 2 * WORLD).to(tl.pointer_type(tl.int32))
    gave_up = failed  # a rank that gave up once no longer waits: its results are void anyway
    spins = 0
    t0 = globaltimer() if USE_CLOCK else 0
    while (waiting > 0) & (gave_up == 0):
        seen = tl.atomic_add(my_flags + ranks, 0, mask=live, sem="acquire", scope="sys")
        waiting = tl.sum(((seen < epoch) & live).to(tl.int32), axis=0)
        spins += 1
        if spins % 64 == 0:
            gave_up = give_up_verdict(status, verdict, spins, t0, timeout, USE_CLOCK)
    if gave_up != failed:
        tl.store(status + 1, gave_up.to(tl.int32))  # status[1] (ERROR), read by the host
        tl.store(state_ptr + G_MAX, gave_up)
    # The acquire above made the peers' copies visible to the polling thread; the barrier
    # extends that to every thread of the program before they read.
    tl.debug_barrier()
    for off in range(0, chunk, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        mask = start + idx < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        # The same rank order on every rank: every rank gets bitwise the same sums.
        for q in tl.static_range(WORLD):
            buf = tl.multiple_of(tl.load(ptrs_ptr + q).to(tl.pointer_type(dtype)) + region, 16)
            # .cg: from L2 (the owner's), never from a line this SM's L1 kept of an old epoch
            acc += tl.load(buf + idx, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(x_ptr + start + idx, acc.to(dtype), mask=mask)


def grid_and_chunk(n: int, g_max: int, block: int = BLOCK) -> tuple[int, int]:
    """Programs for n elements (at most g_max) and the elements each sums (a block multiple)."""
    programs = min(g_max, triton.cdiv(n, block))
    chunk = triton.cdiv(triton.cdiv(n, programs), block) * block
    return triton.cdiv(n, chunk), chunk  # rounding chunk up may leave programs with nothing


def one_shot_all_reduce(
    x: torch.Tensor,
    ptrs: torch.Tensor,
    state: torch.Tensor,
    rank: int,
    world: int,
    g_max: int,
    region_bytes: int,
    timeout: int,
) -> None:
    """Sums x (contiguous, non-empty, at most g_max * region_bytes bytes) over the ranks, in
    place. ptrs: int64 [2 * world + 1] = every rank's data buffer, every rank's flags, this
    rank's pinned status words. timeout: ns on a GPU, spins in the interpreter."""
    n = x.numel()
    programs, chunk = grid_and_chunk(n, g_max)
    region = region_bytes // x.element_size()
    assert chunk <= region, (n, chunk, region)
    _one_shot_all_reduce_kernel[(programs,)](
        x, n, chunk, ptrs, state, rank, timeout,
        WORLD=world, WORLD_POW2=triton.next_power_of_2(world), G_MAX=g_max, REGION=region,
        BLOCK=BLOCK, USE_CLOCK=not INTERPRETED, num_warps=NUM_WARPS,
    )  # fmt: skip
