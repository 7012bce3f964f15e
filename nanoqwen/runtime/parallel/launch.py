"""Starting a tensor-parallel group from LLM(tensor_parallel_size=N): spawned worker ranks
on one machine, or, under torchrun, the ranks torchrun started (on any number of machines)."""

from __future__ import annotations

import os
import sys

import torch

from nanoqwen.errors import InvalidInputError
from nanoqwen.runtime.parallel.group import (
    ParallelContext,
    join_group,
    keep_multicast_off,
    rank_device,
    spawn_store,
    under_torchrun,
)
from nanoqwen.runtime.parallel.processes import WorkerProcesses


def start_group(engine_kwargs: dict, size: int) -> tuple[ParallelContext, WorkerProcesses | None]:
    """Rank 0's context, and the worker processes it spawned (None under torchrun).

    Under torchrun every rank runs the user's script: on ranks other than 0 this call
    becomes the worker loop and ends the process when rank 0 shuts the engine down."""
    keep_multicast_off()
    device = engine_kwargs["device"]
    if under_torchrun():
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != size:
            raise InvalidInputError(
                f"tensor_parallel_size={size} but torchrun started WORLD_SIZE={world} ranks: "
                f"allowed {world}",
                param="tensor_parallel_size",
            )
        local = int(os.environ.get("LOCAL_RANK", rank))
        dev = rank_device(device, local, int(os.environ.get("LOCAL_WORLD_SIZE", size)))
        ctx = join_group(rank, size, dev, "env://")
        if rank == 0:
            return ctx, None
        from nanoqwen.runtime.parallel.worker import run_worker

        run_worker(ctx, {**engine_kwargs, "progress": False})
        sys.exit(0)
    dev = rank_device(device, 0, size)
    store = spawn_store(size)
    workers = WorkerProcesses(size, store.port, {**engine_kwargs, "progress": False})
    try:
        ctx = join_group(0, size, dev, store)
    except BaseException:
        workers.stop(timeout=0)
        raise
    if dev.type == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    return ctx, workers
