"""A faster all-reduce for small messages between GPUs of one machine: Triton kernels over
buffers every rank maps from every other (CUDA IPC), instead of NCCL's ~16 µs per call.

Each rank allocates its buffers, shares their IPC handles over the gloo control group and
opens the others' in its own device's context (peer_memory.py). Two kernels: up to
ll_max_bytes (64 KiB, a decode step's messages) the low-latency one (kernels/
all_reduce_ll.py: data and flag in one packet, one link crossing a call), above it up to
max_bytes the one-shot one (kernels/triton/all_reduce.py: half the bytes, three crossings). The
low-latency one's packets also carry the logits' all-gather, a graph's broadcast of its
inputs, and the all-reduce fused with the residual add and RMSNorm that read a row-parallel
layer's sums (kernels/triton/all_reduce_norm.py, called by model/tensor_parallel.py's
ReducingRMSNorm).
Larger messages, other dtypes, and ranks that cannot map each other's memory (several
machines, no peer access) keep NCCL.

NANOQWEN_CUSTOM_ALL_REDUCE=1 switches it on, =0 off; unset, DEFAULT_SWITCH decides: off
until the low-latency kernels have run on two GPUs (they have on one, shared by two
processes: tests/gpu/*_shared_gpu.py). Each peer's handles are opened in this rank's
device context (peer_memory.PeerUnpickler says why); every wait loop's exit is one
thread's result broadcast to all warps, so no warp leaves a loop the others stay in (a graph
replay would hang); and a tensor-parallel engine frees its graphs before NCCL's
communicator (CUDAGraphRunner.release says why).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401  (registers the tensor reductions ForkingPickler uses)

from nanoqwen.runtime.parallel.peer_memory import PeerUnpickler, RankInfo, refusal

SWITCH_ENV = "NANOQWEN_CUSTOM_ALL_REDUCE"  # "1": on, "0": NCCL for every all-reduce
DEFAULT_SWITCH = "0"
TIMEOUT_ENV = "NANOQWEN_ALL_REDUCE_TIMEOUT_S"
MAX_BYTES_ENV = "NANOQWEN_CUSTOM_ALL_REDUCE_MAX_BYTES"  # the limit below, overridden
LL_MAX_BYTES_ENV = "NANOQWEN_CUSTOM_ALL_REDUCE_LL_MAX_BYTES"  # the low-latency kernel's
DEFAULT_TIMEOUT = timedelta(minutes=10)  # as NCCL's, for ranks that start far apart
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The status words (kernels/triton/all_reduce.py writes the same numbers).
ABORT, ERROR = 0, 1
TIMED_OUT, ABORTED = 1, 2


def max_bytes_for(world: int) -> int:
    """The largest message the custom all-reduce takes. One-shot reads every peer's whole
    message, so NCCL's ring overtakes it sooner as ranks are added: on two GPUs a one-shot
    kernel still wins at a few MB, at 8 at a few hundred KB (vLLM's measurements of its own;
    `tools/allreduce_bench.py --sweep` measures this one). A 7B decode batch of 256 is 1.8 MB."""
    if os.environ.get(MAX_BYTES_ENV):
        return int(os.environ[MAX_BYTES_ENV])
    return 4 << 20 if world == 2 else 512 << 10 if world <= 4 else 256 << 10


def ll_max_bytes_from_env(given: int | None) -> int:
    """The largest message the low-latency kernel takes (larger ones: the one-shot kernel).
    It moves twice the bytes for one link crossing instead of three: a decode step's
    messages (7 KiB for a 7B token) are latency, not bandwidth."""
    if given is not None:
        return given
    value = os.environ.get(LL_MAX_BYTES_ENV)
    return int(value) if value else 64 << 10


def timeout_from_env() -> timedelta:
    value = os.environ.get(TIMEOUT_ENV)
    return timedelta(seconds=float(value)) if value else DEFAULT_TIMEOUT


class CustomAllReduce:
    """Sums a tensor over the ranks in place (__call__), when it fits; built collectively by
    every rank of the group. Falls back on nothing itself: TensorParallel.all_reduce does."""

    def __init__(
        self,
        rank: int,
        world: int,
        device: torch.device,
        group: dist.ProcessGroup,
        programs: int,
        max_bytes: int,
        timeout: timedelta = DEFAULT_TIMEOUT,
        ll_max_bytes: int | None = None,
    ) -> None:
        # triton: only where this runs
        from nanoqwen.kernels.triton import all_reduce as kernel
        from nanoqwen.kernels.triton import all_reduce_ll as ll_kernel
        from nanoqwen.kernels.triton import all_reduce_norm as norm_kernel

        self.kernel, self.ll_kernel, self.norm_kernel = kernel, ll_kernel, norm_kernel
        self.rank, self.world, self.device = rank, world, device
        self.timeout_s = timeout.total_seconds()
        self.max_bytes = max_bytes
        self.ll_max_bytes = min(max_bytes, ll_max_bytes_from_env(ll_max_bytes))
        self.g_max = programs  # grid limit: every program must be resident (they wait)
        unit = kernel.BLOCK * 4  # a whole number of BLOCKs of any dtype
        self.region_bytes = -(-max_bytes // programs // unit) * unit
        self.data = torch.empty(2 * programs * self.region_bytes, dtype=torch.uint8, device=device)
        self.flags = torch.zeros(programs * world, dtype=torch.int64, device=device)
        # A region also holds a whole row of the fused all-reduce + RMSNorm (one per program).
        self.ll_region = max(
            ll_kernel.region_words(self.ll_max_bytes, programs),
            norm_kernel.ROW_WORDS if self.ll_max_bytes else 0,
        )
        self.ll = torch.zeros(
            2 * programs * world * self.ll_region, dtype=torch.int64, device=device
        )
        # One-shot epochs, the failed word (both kernels'), one-shot verdicts (kernels/
        # all_reduce.py), then the low-latency kernel's epochs and verdicts (all_reduce_ll.py).
        self.state = torch.zeros(4 * programs + 1, dtype=torch.int64, device=device)
        self.ll_state = self.state[2 * programs + 1 :]
        self.failed = self.state[programs : programs + 1]
        # ABORT (the host asks spinning kernels to stop) and ERROR (a kernel gave up), in
        # host memory the GPU writes and reads directly, so neither side waits for the other.
        self.status = torch.zeros(2, dtype=torch.int32)
        if device.type == "cuda":
            self.status = self.status.pin_memory()
            self.timeout = int(timeout.total_seconds() * 1e9)  # ns of the GPU's global timer
            torch.cuda.synchronize(device)  # the zeroed flags, before any peer can signal
        else:  # Triton's CPU interpreter (tests): spins of the wait loop
            self.timeout = max(1, int(timeout.total_seconds() * 1000))
        self.status_words = self.status.numpy()  # the per-step check, in ~100 ns
        self.peers = self._exchange(group)
        status = [self.status.data_ptr()]
        table = [d.data_ptr() for d, _, _ in self.peers] + [f.data_ptr() for _, f, _ in self.peers]
        self.ptrs = torch.tensor(table + status, dtype=torch.int64).to(device)
        ll_table = [ll.data_ptr() for _, _, ll in self.peers]
        self.ll_buffers = ll_kernel.LowLatencyBuffers(
            torch.tensor(ll_table + status, dtype=torch.int64).to(device), self.ll_state,
            self.failed, rank, world, programs, self.ll_region, self.timeout,
        )  # fmt: skip

    def _exchange(self, group) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Every rank's (data, flags, ll), opened in this process: IPC handles for CUDA
        tensors, shared-memory files for CPU ones (with the file_system sharing strategy)."""
        mine, failure = None, None
        try:
            mine = bytes(ForkingPickler.dumps((self.data, self.flags, self.ll)))
        except Exception as e:  # noqa: BLE001  (every rank learns it below, and all refuse)
            failure = f"rank {self.rank} could not share its buffers ({e})"
        gathered: list[bytes | None] = [None] * self.world
        dist.all_gather_object(gathered, mine, group=group)
        peers = []
        for q, blob in enumerate(gathered):
            if q == self.rank or blob is None:  # a rank that could not share says so itself
                peers.append((self.data, self.flags, self.ll))
                continue
            try:
                peers.append(PeerUnpickler(blob, self.device).load())
            except Exception as e:  # noqa: BLE001
                failure = failure or f"rank {self.rank} could not open rank {q}'s buffers ({e})"
        failures: list[str | None] = [None] * self.world
        dist.all_gather_object(failures, failure, group=group)
        reasons = [f for f in failures if f]
        if reasons:
            raise RuntimeError("; ".join(reasons))
        return peers

    def fits(self, x: torch.Tensor) -> bool:
        return (
            x.device == self.device
            and x.dtype in DTYPES
            and x.numel() * x.element_size() <= self.max_bytes
            and x.is_contiguous()
        )

    def __call__(self, x: torch.Tensor) -> bool:
        """Sums x over the ranks in place and returns True, or returns False (x untouched)
        where x is not one this all-reduce takes. Every rank must make the same calls."""
        if not self.fits(x):
            return False
        nbytes = x.numel() * x.element_size()
        if nbytes == 0:
            return True
        if nbytes <= self.ll_max_bytes and self._takes_words(x):
            self.ll_kernel.ll_all_reduce(x, self.ll_buffers)
        else:
            self.kernel.one_shot_all_reduce(
                x, self.ptrs, self.state, self.rank, self.world, self.g_max,
                self.region_bytes, self.timeout,
            )  # fmt: skip
        return True

    def _takes_words(self, *tensors: torch.Tensor) -> bool:
        """Whether the low-latency kernel takes these as whole 4-byte words."""
        return bool(self.ll_max_bytes) and all(
            t.device == self.device
            and t.is_contiguous()
            and t.numel() * t.element_size() % 4 == 0
            and t.data_ptr() % 4 == 0
            for t in tensors
        )

    def all_gather(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """Every rank's x into out in rank order (NCCL's all_gather_into_tensor layout) through
        the low-latency kernel, and True; or False (out untouched) where that does not take x.
        Every rank must make the same calls."""
        nbytes = x.numel() * x.element_size()
        if not (
            self._takes_words(x, out)
            and out.dtype == x.dtype
            and out.numel() == self.world * x.numel()
            and nbytes // 4 <= self.g_max * self.ll_region
        ):
            return False
        if nbytes:
            self.ll_kernel.ll_all_gather(x, out, self.ll_buffers)
        return True

    def broadcast(self, x: torch.Tensor) -> bool:
        """Rank 0's x into every rank's x, in place, through the low-latency kernel, and True;
        or False (x untouched) where that does not take x. Every rank must make the same
        calls."""
        nbytes = x.numel() * x.element_size()
        if not (self._takes_words(x) and nbytes // 4 <= self.g_max * self.ll_region):
            return False
        if nbytes:
            self.ll_kernel.ll_all_gather(x, x, self.ll_buffers, source=0)
        return True

    def takes_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether all_reduce_rms_norm takes x [rows, cols] and its residual: a message the
        low-latency kernel takes, a row per program."""
        return (
            self._takes_words(x, *([] if residual is None else [residual]))
            and x.dim() == 2
            and x.numel() * x.element_size() <= self.ll_max_bytes
            and self.norm_kernel.fits(x, self.g_max, self.ll_region)
            and (residual is None or (residual.shape, residual.dtype) == (x.shape, x.dtype))
        )

    def all_reduce_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm.forward's (normed, residual stream) of x summed over the ranks, in one
        kernel (takes_rms_norm(x, residual) must hold; every rank must make the same calls)."""
        out = self.norm_kernel.all_reduce_rms_norm(x, residual, weight, eps, self.ll_buffers)
        return out, residual if residual is not None else x

    def error(self) -> str | None:
        """Why a kernel gave up waiting for the other ranks (its sums and every later one on
        this rank are void), or None. Reads host memory: no sync."""
        code = int(self.status_words[ERROR])
        if code == TIMED_OUT:
            return (
                f"the custom all-reduce on rank {self.rank} waited longer than {TIMEOUT_ENV}="
                f"{self.timeout_s:g} s for another rank"
            )
        if code == ABORTED:
            return f"the custom all-reduce on rank {self.rank} was aborted"
        return None

    def abort(self) -> None:
        """Makes kernels waiting for a rank that will never come give up (within µs)."""
        self.status_words[ABORT] = 1


_active: list[CustomAllReduce] = []


def create(
    rank: int, world: int, device: torch.device, group: dist.ProcessGroup
) -> CustomAllReduce | None:
    """The group's custom all-reduce (a collective over the gloo group), or None where it
    cannot run or is switched off; rank 0 says which on stderr."""
    if world < 2 or device.type != "cuda" or os.environ.get(SWITCH_ENV, DEFAULT_SWITCH) != "1":
        return None
    infos: list[RankInfo | None] = [None] * world
    dist.all_gather_object(infos, RankInfo.local(device), group=group)
    reason = refusal(infos)
    custom = None
    if reason is None:
        programs = min(i.programs for i in infos)
        try:
            custom = CustomAllReduce(
                rank, world, device, group, programs, max_bytes_for(world), timeout_from_env()
            )
        except RuntimeError as e:  # every rank raises together (_exchange)
            reason = str(e)
    if rank == 0:
        what = (
            f"custom, low-latency up to {custom.ll_max_bytes >> 10} KiB and one-shot up to "
            f"{custom.max_bytes >> 10} KiB, NCCL above"
            if custom is not None
            else f"NCCL ({reason})"
        )
        print(f"[nanoqwen] tensor-parallel all-reduce: {what}", file=sys.stderr, flush=True)
    if custom is not None:
        _active.append(custom)
    return custom


def abort_all() -> None:
    """On leaving the group: no kernel of this process keeps waiting for a departed rank."""
    while _active:
        _active.pop().abort()


def release_all() -> None:
    """On leaving the group together: this process lets go of the other ranks' buffers
    before any of them exits (a rank that exits while another still maps its memory warns
    "Producer process has been terminated before all shared CUDA tensors released")."""
    for custom in _active:
        custom.peers = []
    abort_all()
