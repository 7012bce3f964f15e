"""The worker processes rank 0 starts, watches and stops."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from multiprocessing.connection import wait

import torch.multiprocessing as mp


class WorkerProcesses:
    """Ranks 1..size-1 as spawned processes (daemonic: they end with this process, and each
    also watches this process and exits when it dies, so none is ever orphaned)."""

    def __init__(self, size: int, port: int, engine_kwargs: dict) -> None:
        """port: rank 0's rendezvous store (group.spawn_store)."""
        from nanoqwen.runtime.parallel.worker import worker_main

        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=worker_main,
                args=(rank, size, port, engine_kwargs),
                name=f"nanoqwen-tp-rank{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for p in self.procs:
            p.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def dead(self, timeout: float = 0.0) -> str | None:
        """Which rank has exited, waiting up to timeout for one to; None while all run."""
        sentinels = [p.sentinel for p in self.procs]
        end = time.monotonic() + timeout
        if timeout > 0:
            wait(sentinels, timeout)
        while True:
            reason = self._exited()
            # A process's sentinel closes as it starts to exit, a moment before it can be
            # reaped (a large process takes a while to tear down): wait for that moment.
            if reason is not None or time.monotonic() >= end or not wait(sentinels, 0):
                return reason
            time.sleep(0.005)

    def _exited(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                how = (
                    f"was killed by signal {-p.exitcode}"
                    if p.exitcode < 0
                    else f"exited with code {p.exitcode}"
                )
                return f"tensor-parallel rank {rank} (pid {p.pid}) {how}"
        return None

    def stop(self, timeout: float = 10.0) -> None:
        """Waits for the workers to leave (after a shutdown message), then ends stragglers."""
        end = time.monotonic() + timeout
        for p in self.procs:
            # join with a timeout > 0 reaps a process whose exit has begun (see dead()).
            p.join(max(1e-3, end - time.monotonic()))
        for p in self.procs:
            if p.exitcode is None:
                p.terminate()
        for p in self.procs:
            p.join(5)
            if p.exitcode is None:
                p.kill()
                p.join()


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


@contextlib.contextmanager
def sigint_deferred():
    """Ctrl-C during the block takes effect at its end, so a step is never half sent: the
    other ranks would wait for the rest of it."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is None  # a handler set outside Python: keep it
    ):
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(signal.SIGINT, None)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt
