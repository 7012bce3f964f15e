"""Ranks 1..N-1: each holds its part of the model and KV cache and repeats, step by step,
what rank 0 tells it to run. Rank 0 keeps the scheduler, block manager and sampler."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

import torch
import torch.multiprocessing as mp
from tqdm import tqdm

from nanoqwen.errors import InvalidInputError
from nanoqwen.runtime.config import EngineConfig
from nanoqwen.runtime.kv.cache import KVCache
from nanoqwen.runtime.kv.host_pool import HostKVCache
from nanoqwen.runtime.parallel.group import (
    ParallelContext,
    TensorParallelError,
    join_group,
    leave_group,
    release_graphs,
    spawn_store,
)
from nanoqwen.runtime.parallel.message import Field, Op, StepChannel, decode_copies, step_of
from nanoqwen.runtime.parallel.rank_errors import report_error
from nanoqwen.runtime.sampling.filter_stage import FilterStage

SYNC_DEBUG_ENV = "NANOQWEN_WORKER_SYNC_DEBUG"


class WorkerRunner:
    """What a non-zero rank runs: no sampler, inputs from rank 0's messages."""

    sampler = None  # the graph capture leaves the sampler out

    def __init__(
        self,
        model,
        kv: KVCache,
        host: HostKVCache | None,
        graphs,
        prefill_graphs,
        ctx: ParallelContext,
    ) -> None:
        self.model = model
        self.kv = kv
        self.host = host
        self.graphs = graphs
        self.prefill_graphs = prefill_graphs
        self.device = ctx.device
        self.channel = StepChannel(ctx)
        self.custom_all_reduce = ctx.tp.custom_all_reduce
        model.bind_kv_cache(kv.k, kv.v)

    @torch.inference_mode()
    def serve(self) -> None:
        """Runs steps until rank 0 sends SHUTDOWN."""
        while True:
            h, extra = self.channel.receive()
            if h[Field.OP] == Op.SHUTDOWN:
                return
            # A kernel that gave up waiting left void sums here: exit, and rank 0 stops.
            reason = self.custom_all_reduce and self.custom_all_reduce.error()
            if reason:
                raise TensorParallelError(reason)
            n = 2 * h[Field.PROMPT_ROWS]
            prompt_rows = [(extra[i], extra[i + 1]) for i in range(0, n, 2)]
            for direction, a, b in decode_copies(extra[n:]):
                (self.host.copy_out if direction == 0 else self.host.copy_in)(a, b)
            if h[Field.OP] == Op.GRAPH:
                stage = FilterStage(h[Field.GRAPH_FILTERING])
                key = (
                    h[Field.GRAPH_BS],
                    h[Field.GRAPH_VARIANT],
                    stage,
                    bool(h[Field.GRAPH_CASCADE]),
                )
                self.graphs.replay(key)  # its first kernel receives rank 0's inputs
            elif h[Field.OP] == Op.PREFILL_GRAPH:
                key = (h[Field.GRAPH_BS], h[Field.GRAPH_VARIANT], bool(h[Field.GRAPH_FILTERING]))
                self.prefill_graphs.replay(key)
            else:
                self._step(h, prompt_rows)

    def _step(self, h: list[int], prompt_rows: list[tuple[int, int]]) -> None:
        """The same model calls as rank 0's execute(), in the same order: every all-reduce
        and logits gather pairs with rank 0's."""
        payload = torch.empty(h[Field.PAYLOAD], dtype=torch.int64, device=self.device)
        self.channel.share(payload)
        ids, meta, rows = step_of(h, payload)
        x, residual = self.model(ids, meta)
        for start, end in prompt_rows:
            self.model.compute_logits((x[start:end], residual[start:end]))
        if rows is not None:
            x, residual = x[rows], residual[rows]
        self.model.compute_logits((x, residual))


def exit_with_parent() -> None:
    """In a worker: end this process as soon as the process that spawned it is gone (killed
    or crashed), instead of waiting forever in a collective."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="nanoqwen-parent-watch", daemon=True).start()


def run_worker(ctx: ParallelContext, config: EngineConfig, build: Callable) -> None:
    """Builds this rank's engine and serves rank 0's steps; leaves the group at the end,
    with the other ranks after SHUTDOWN, alone after a failure."""
    worker, shut_down = None, False
    try:
        worker = build(config, parallel=ctx)
        # The GPU tests' no-host-sync check, on this rank's steps (rank 0 checks its own).
        debug = ctx.device.type == "cuda" and os.environ.get(SYNC_DEBUG_ENV) == "error"
        if debug:
            torch.cuda.set_sync_debug_mode("error")
        try:
            worker.serve()
        finally:
            if debug:
                torch.cuda.set_sync_debug_mode("default")
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        shut_down = True
    finally:
        if worker is not None:
            release_graphs(worker)
        leave_group(ctx.control if shut_down else None)


def worker_main(rank: int, size: int, port: int, config: EngineConfig, build: Callable) -> None:
    """Entry point of a spawned rank."""
    # Ctrl-C reaches the whole process group; rank 0 decides, and tells the others.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    # tqdm (the loaders' progress bars, off here) makes a multiprocessing lock: a named
    # semaphore in /dev/shm that a rank killed by a signal would leave behind.
    tqdm.set_lock(threading.RLock())
    device = torch.device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
    else:  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    try:
        ctx = join_group(rank, size, device, spawn_store(size, port))
        run_worker(ctx, config, build)
    except InvalidInputError as e:  # rank 0 refuses the same arguments with the same error
        report_error(rank, str(e))
        print(f"[nanoqwen] tensor-parallel rank {rank}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except BaseException as e:  # the traceback goes to stderr; rank 0 quotes its last line
        report_error(rank, f"{type(e).__name__}: {e}")
        raise
