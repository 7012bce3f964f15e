"""Starting a tensor-parallel group from LLM(tensor_parallel_size=N): spawned worker ranks
on one machine, or, under torchrun, the ranks torchrun started (on any number of machines)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import replace

import torch

from nanoqwen.errors import InvalidInputError
from nanoqwen.runtime.config import EngineConfig
from nanoqwen.runtime.device_choice import device_name
from nanoqwen.runtime.parallel.group import (
    ParallelContext,
    TensorParallelError,
    join_group,
    keep_multicast_off,
    leave_group,
    rank_device,
    spawn_store,
    under_torchrun,
)
from nanoqwen.runtime.parallel.processes import WorkerProcesses
from nanoqwen.runtime.parallel.rank_errors import (
    main_script_for_spawn,
    refuse_spawn_while_bootstrapping,
)
from nanoqwen.runtime.parallel.watched_store import WatchedStore
from nanoqwen.runtime.parallel.worker import run_worker


def start_group(
    config: EngineConfig, build: Callable
) -> tuple[ParallelContext, WorkerProcesses | None]:
    """Rank 0's context, and the worker processes it spawned (None under torchrun).

    Under torchrun every rank runs the user's script: on ranks other than 0 this call
    becomes the worker loop and ends the process when rank 0 shuts the engine down."""
    keep_multicast_off()
    size, device = config.tensor_parallel_size, device_name(config.device)
    quiet = replace(config, device=device, progress=False)  # what the other ranks build
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
        run_worker(ctx, quiet, build)
        sys.exit(0)
    refuse_spawn_while_bootstrapping()  # before this rank would listen and spawn in turn
    why_not = main_script_for_spawn()
    if why_not is not None:
        raise TensorParallelError(why_not)
    dev = rank_device(device, 0, size)
    store = spawn_store(size)
    workers = WorkerProcesses(size, store.port, quiet, build)
    # A rank that dies before it joins fails the rendezvous at once, not at the store's
    # timeout. The process group holds the WatchedStore's C++ part only: its Python part, and
    # the TCPStore it forwards to (whose server the other ranks talk to), live as long as
    # the workers do, or a garbage collection closes the server under the ranks.
    workers.rendezvous = WatchedStore(store, workers.check_starting)
    try:
        ctx = join_group(0, size, dev, workers.rendezvous)
    except BaseException as e:
        error = workers.stop_after(e)
        leave_group()
        if error is e:
            raise
        raise error from e
    if dev.type == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    return ctx, workers
