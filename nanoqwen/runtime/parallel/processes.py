"""The worker processes rank 0 starts, watches and stops."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait

import torch.multiprocessing as mp

from nanoqwen.runtime.config import EngineConfig
from nanoqwen.runtime.parallel.group import TensorParallelError
from nanoqwen.runtime.parallel.rank_errors import ERROR_DIR_ENV, RANK_NAME, read_error
from nanoqwen.runtime.parallel.worker import worker_main


class WorkerProcesses:
    """Ranks 1..size-1 as spawned processes (daemonic: they end with this process, and each
    also watches this process and exits when it dies, so none is ever orphaned)."""

    def __init__(self, size: int, port: int, config: EngineConfig, build: Callable) -> None:
        """port: rank 0's rendezvous store (group.spawn_store); build: the function each
        worker builds its engine with (builder.build_engine)."""
        ctx = mp.get_context("spawn")
        self.error_dir = tempfile.mkdtemp(prefix="nanoqwen-tp-")  # rank_errors.py
        self.rendezvous: object | None = None  # the store the group was made with (launch.py)
        self.procs = [
            ctx.Process(
                target=worker_main,
                args=(rank, size, port, config, build),
                name=f"{RANK_NAME}{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        previous = os.environ.get(ERROR_DIR_ENV)
        os.environ[ERROR_DIR_ENV] = self.error_dir  # the ranks inherit it as they start
        try:
            for p in self.procs:
                p.start()
        finally:
            if previous is None:
                del os.environ[ERROR_DIR_ENV]
            else:
                os.environ[ERROR_DIR_ENV] = previous

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
                line = read_error(self.error_dir, rank)
                why = f" ({line})" if line else ""
                return f"tensor-parallel rank {rank} (pid {p.pid}) {how}{why}"
        return None

    def check(self, outcome: str = "the engine is shut down") -> None:
        """Raises TensorParallelError naming a rank that has exited."""
        reason = self.dead()
        if reason is not None:
            raise TensorParallelError(f"{reason}; {outcome}")

    def check_starting(self) -> None:
        self.check("the engine did not start")

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
        shutil.rmtree(self.error_dir, ignore_errors=True)

    def stop_after(self, error: BaseException) -> BaseException:
        """Stops the ranks after start-up failed with error, and returns what to raise: a
        dead rank's TensorParallelError (with its own error line) rather than the broken
        collective its death left rank 0 with."""
        # A collective fails as soon as a peer's socket closes, a moment before its exit.
        reason = self.dead(timeout=2.0) if isinstance(error, RuntimeError) else None
        self.stop(timeout=0)
        if reason is None or isinstance(error, TensorParallelError):
            return error
        return TensorParallelError(f"{reason}; the engine did not start")


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
