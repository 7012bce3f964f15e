"""Joining the tensor-parallel process group: NCCL between GPUs, gloo on the CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nanoqwen.errors import InvalidInputError
from nanoqwen.model.tensor_parallel import TensorParallel

# NVLink multicast stays off on the lent multi-GPU machines (their KINDS.md says why); every
# rank starts with these, whatever launched it.
NVLS_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# Collectives inside steps: a peer that stops answering for this long fails the step.
STEP_TIMEOUT = timedelta(minutes=10)
# The other ranks wait for rank 0's next step for as long as the engine sits idle.
IDLE_TIMEOUT = timedelta(days=365)
# Leaving the group together: how long a rank waits at close() for the others to arrive.
LEAVE_TIMEOUT = timedelta(seconds=30)


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group died or stopped answering; the engine is shut
    down and cannot run further steps."""


@dataclass
class ParallelContext:
    """One rank's view of the group: its place (tp), the gloo group that carries rank 0's
    per-step headers (control), and the device it runs on."""

    tp: TensorParallel
    control: dist.ProcessGroup
    device: torch.device


def keep_multicast_off() -> None:
    for key, value in NVLS_OFF.items():
        os.environ.setdefault(key, value)


def spawn_store(size: int, port: int | None = None) -> dist.TCPStore:
    """The rendezvous of the ranks rank 0 spawns. Rank 0 (port None) listens on a port the
    OS picks and keeps it from then on; the workers connect to that port. Choosing a free
    port first and listening on it later left a window in which another process took it:
    EADDRINUSE, seen on a two-GPU machine."""
    master = port is None
    return dist.TCPStore(
        "127.0.0.1", 0 if master else port, size, is_master=master, timeout=STEP_TIMEOUT,
        wait_for_workers=False,
    )  # fmt: skip


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def rank_device(device: str, local_rank: int, size: int) -> torch.device:
    """cpu, or the local_rank-th GPU for device "cuda" (one GPU per rank)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda" or dev.index is not None:
        raise InvalidInputError(
            f"device={device!r} with tensor_parallel_size={size}: allowed cpu or cuda "
            "(rank r runs on cuda:r)",
            param="device",
        )
    if not torch.cuda.is_available() or torch.cuda.device_count() < size:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise InvalidInputError(
            f"tensor_parallel_size={size} needs {size} GPUs, this machine has {found}: "
            f"allowed at most {max(found, 1)}",
            param="tensor_parallel_size",
        )
    return torch.device("cuda", local_rank)


def join_group(
    rank: int, size: int, device: torch.device, rendezvous: str | dist.Store
) -> ParallelContext:
    """Joins the default process group (NCCL on CUDA, gloo on CPU) and the gloo control
    group; rendezvous: a spawn_store(), or "env://" (torchrun's MASTER_ADDR/MASTER_PORT)."""
    keep_multicast_off()
    if dist.is_initialized():
        raise TensorParallelError(
            "a tensor-parallel engine is already running in this process: close() it first"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=rendezvous if isinstance(rendezvous, str) else None,
        store=None if isinstance(rendezvous, str) else rendezvous,
        rank=rank,
        world_size=size,
        timeout=STEP_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    from nanoqwen.runtime.parallel import custom_all_reduce

    custom = custom_all_reduce.create(rank, size, device, control)
    return ParallelContext(TensorParallel(rank, size, None, custom), control, device)


def release_graphs(runner) -> None:
    """Frees a runner's decode and prefill graphs, which a rank must do before it leaves
    the group (CUDAGraphRunner.release says why)."""
    for graphs in (runner.graphs, runner.prefill_graphs):
        if graphs is not None:
            graphs.release()


def leave_group(control: dist.ProcessGroup | None = None) -> None:
    """Frees this rank's process groups.

    control given: every rank calls this at the same point (each after the engine's shutdown
    message) and they leave together: each drops the other ranks' custom all-reduce buffers,
    waits for the others on the gloo control group (bounded), then destroys its groups.
    NCCL's destroy flushes through ncclCommFinalize, which waits for every rank, so it must
    not run alone. A rank that does not reach the barrier makes this one leave alone.
    control None: this rank leaves alone (a peer died, or a step failed)."""
    from nanoqwen.runtime.parallel import custom_all_reduce

    if not dist.is_initialized():
        return
    if control is not None:
        custom_all_reduce.release_all()
        try:
            dist.monitored_barrier(group=control, timeout=LEAVE_TIMEOUT)
        except RuntimeError:
            pass  # a rank that did not come: leave alone
        else:
            dist.destroy_process_group()
            return
    _leave_alone()


def _leave_alone() -> None:
    """Without waiting for any other rank: kernels waiting for a peer give up, and NCCL's
    communicators are aborted (destroying one whose peer is gone blocks in its finalize).
    The callers synchronize first where they can, so nothing is in flight that an abort cuts."""
    from nanoqwen.runtime.parallel import custom_all_reduce

    custom_all_reduce.abort_all()
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.get_backend() == "nccl":
        abort()
    else:
        dist.destroy_process_group()
