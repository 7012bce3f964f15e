"""Starting the engine process and waiting until its model is loaded: what the server does
once at start-up, and again after the engine process died when it runs with
--restart-engine."""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from nanoqwen.errors import EngineError, InvalidInputError
from nanoqwen.runtime.config import EngineConfig
from nanoqwen.serve.engine_core import engine_main
from nanoqwen.serve.messages import EngineReady, EngineStartupError


def spawn_engine(
    config: EngineConfig, stream_interval: int
) -> tuple[Connection, Connection, BaseProcess]:
    """The engine process (spawn: a fresh interpreter, safe for CUDA) and the two pipe ends
    this process keeps: (its inputs, its outputs, the process)."""
    ctx = multiprocessing.get_context("spawn")
    in_recv, in_send = ctx.Pipe(duplex=False)
    out_recv, out_send = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=engine_main,
        args=(config, stream_interval, in_recv, out_send),
        name="nanoqwen-engine",
    )
    process.start()
    # Only the engine holds these ends now, so its exit closes the pipe for the reader.
    in_recv.close()
    out_send.close()
    return in_send, out_recv, process


def wait_until_loaded(outputs: Connection, process: BaseProcess) -> EngineReady:
    """Blocks until the model is loaded; a load failure raises the CLI's error for it."""
    try:
        first = outputs.recv()
    except EOFError:
        process.join(5)
        raise EngineError(
            f"the engine process exited while loading (exit code {process.exitcode})"
        ) from None
    if isinstance(first, EngineStartupError):
        process.join(10)
        raise (InvalidInputError if first.exit_code == 2 else EngineError)(first.message)
    assert isinstance(first, EngineReady), first
    return first
