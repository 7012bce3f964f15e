"""The HTTP process's side of the engine process: starts it, sends it requests and aborts,
and hands what each step made to the requests' handlers.

Handlers call submit() and abort() on the event loop; both only queue messages for a
BatchSender thread. A reader thread waits on the engine's pipe and passes each batch of
StepOutputs to the event loop (one call_soon_threadsafe per read), where dispatch() pushes
every request's new tokens to its Generation and updates the metrics. The HTTP process never
touches the model or the device."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Protocol

from nanoqwen.runtime.config import EngineConfig
from nanoqwen.runtime.logprobs import TokenLogprobs
from nanoqwen.runtime.sampling_params import SamplingParams
from nanoqwen.serve.batch_sender import BatchSender, receive
from nanoqwen.serve.engine_process import spawn_engine, wait_until_loaded
from nanoqwen.serve.messages import (
    AbortRequest,
    AddRequest,
    EngineReady,
    EngineStats,
    Shutdown,
    StepOutputs,
)
from nanoqwen.serve.metrics import ServingMetrics

log = logging.getLogger("nanoqwen.serve")


class EngineDeadError(RuntimeError):
    pass


@dataclass(slots=True)
class ChoiceOutput:
    """What one choice made: all of it, or since the last batch when streaming."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # set once the choice is finished
    cached_tokens: int | None = None  # prompt tokens the prefix cache held, once finished
    # With prompt logprobs asked for: one per prompt token (None for the first), on the
    # choice's first part.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def merge(self, part: ChoiceOutput) -> None:
        self.text += part.text
        self.token_ids.extend(part.token_ids)  # its own list: each part's is new
        if part.logprobs is not None:  # extended in place: a long answer merges many parts
            if self.logprobs is None:
                self.logprobs = list(part.logprobs)
            else:
                self.logprobs.extend(part.logprobs)
        self.finish_reason = part.finish_reason or self.finish_reason
        if part.cached_tokens is not None:
            self.cached_tokens = part.cached_tokens
        if part.prompt_logprobs is not None:
            self.prompt_logprobs = part.prompt_logprobs


class Sink(Protocol):
    def push(self, index: int, payload) -> None: ...


@dataclass(eq=False)
class EngineRequest:
    """One sequence run for a handler: choice `index` of its response. sink.push(index, part)
    runs on the event loop with each new ChoiceOutput, or an exception if the engine failed."""

    prompt_ids: list[int]
    params: SamplingParams
    index: int
    sink: Sink
    request_id: int = -1
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    num_output_tokens: int = 0


class EngineClient:
    def __init__(
        self,
        inputs: Connection,
        outputs: Connection,
        process: BaseProcess | None = None,
        metrics: ServingMetrics | None = None,
    ) -> None:
        self.process = process
        self.metrics = metrics
        self._outputs = outputs
        self._sender = BatchSender(inputs, "nanoqwen-engine-input")
        self._requests: dict[int, EngineRequest] = {}
        self._ids = itertools.count()
        self._num_submitted = 0
        self._stats: EngineStats | None = None
        self._reader: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._shut_down = False
        self.exit_message: str | None = None  # why the engine is gone, once it is
        # Called on the event loop once the engine is gone and its requests have failed
        # (and, with restart_engine, a new one failed to load): the server then stops, so
        # that a supervisor starts a new one.
        self.on_exit: Callable[[], None] | None = None
        # --restart-engine: a new engine process takes over from one that died.
        self.restart_engine = False
        self.num_restarts = 0
        self.config: EngineConfig | None = None  # what launch() started the engine with
        self.stream_interval = 1

    # ---- the engine process's life ------------------------------------------------------------
    @classmethod
    def launch(cls, config: EngineConfig, stream_interval: int) -> EngineClient:
        """Starts the engine process; wait_ready() waits for its model."""
        client = cls(*spawn_engine(config, stream_interval))
        client.config, client.stream_interval = config, stream_interval
        return client

    def wait_ready(self) -> EngineReady:
        """Blocks until the model is loaded; a load failure raises the CLI's error for it."""
        return wait_until_loaded(self._outputs, self.process)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starts handing outputs to handlers on `loop` (call it from the loop)."""
        self._loop = loop
        self._reader = threading.Thread(target=self._read, name="nanoqwen-engine-output")
        self._reader.daemon = True
        self._reader.start()

    def kill(self) -> None:
        """Ends the engine process at once (it failed to load, or loading was interrupted)."""
        self._closing = True
        if self.process is not None and self.process.is_alive():
            self.process.kill()
        self.shutdown()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Asks the engine process to stop and waits for it; forces it after `timeout`.
        Calling it again does nothing."""
        if self._shut_down:
            return
        self._shut_down = True
        self._closing = True
        self._sender.put(Shutdown())
        self._sender.close(timeout)
        if self.process is not None:
            self.process.join(timeout)
            if self.process.is_alive():
                log.warning("the engine process did not stop in %.0f s: killing it", timeout)
                self.process.kill()
                self.process.join()
        if self._reader is not None:
            self._reader.join(timeout)
        self._outputs.close()

    @property
    def alive(self) -> bool:
        if self.exit_message is not None:
            return False
        return self.process is None or self.process.is_alive()

    # ---- called by handlers on the event loop -----------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Sequences not yet running: in the scheduler's queue or not yet taken in."""
        if self._stats is None:
            return self._num_submitted
        return self._stats.num_waiting + self._num_submitted - self._stats.num_added

    def submit(self, requests: list[EngineRequest]) -> None:
        if not self.alive:
            raise EngineDeadError(self.exit_message or "the engine process is not running")
        items = []
        for r in requests:
            r.request_id = next(self._ids)
            self._requests[r.request_id] = r
            items.append(AddRequest(r.request_id, r.prompt_ids, r.params))
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(r.prompt_ids))
                self.metrics.prompt_len.observe(len(r.prompt_ids))
        self._num_submitted += len(items)
        self._sender.put_all(items)

    def abort(self, requests: list[EngineRequest]) -> None:
        """Ends the requests that are not finished; their KV blocks are free after the
        engine's current step. Their sinks get nothing more."""
        items = []
        for r in requests:
            if self._requests.pop(r.request_id, None) is not None:
                items.append(AbortRequest(r.request_id))
                if self.metrics is not None:
                    self.metrics.finished("abort")
        if items:
            self._sender.put_all(items)

    # ---- outputs --------------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                batch = receive(self._outputs)
            except (EOFError, OSError):
                batch = None
            try:
                if batch is None:
                    self._loop.call_soon_threadsafe(self._engine_gone)
                    return
                self._loop.call_soon_threadsafe(self.dispatch, batch)
            except RuntimeError:  # the event loop is closed: the server is shutting down
                return

    def dispatch(self, batch: list[StepOutputs]) -> None:
        now = time.perf_counter()
        num_tokens = 0
        requests = self._requests
        for out in batch:
            # The hot path: one token per running request, nothing finished.
            for request_id, token, text in zip(out.request_ids, out.token_ids, out.texts):
                r = requests.get(request_id)
                if r is None:
                    continue  # aborted by its handler
                if r.first_token_time is None:
                    r.first_token_time = now
                    if self.metrics is not None:
                        self.metrics.ttft.observe(now - r.arrival_time)
                r.num_output_tokens += 1
                num_tokens += 1
                r.sink.push(r.index, ChoiceOutput(text, [token]))
            for request_id, text, token_ids, finished, reason, logprobs, extras in out.rows:
                r = requests.get(request_id)
                if r is None:
                    continue
                if finished:
                    del requests[request_id]
                    reason = reason or "length"
                part = ChoiceOutput(text, token_ids, logprobs, reason if finished else None)
                if extras is not None:
                    part.cached_tokens = extras.cached_tokens
                    part.prompt_logprobs = extras.prompt_logprobs
                num_tokens += len(token_ids)
                self._record(r, part, now)
                r.sink.push(r.index, part)
            for request_id, why in out.failed:
                r = requests.pop(request_id, None)
                if r is not None:
                    r.sink.push(r.index, RuntimeError(why))
            if out.stats is not None:
                self._stats = out.stats
        if self.metrics is not None:
            self.metrics.generation_tokens.inc(num_tokens)  # once, not per request
        if self.metrics is not None and self._stats is not None:
            self.metrics.set_engine_state(self._stats)

    def _record(self, r: EngineRequest, part: ChoiceOutput, now: float) -> None:
        num_new = len(part.token_ids)
        if r.first_token_time is None and num_new:
            r.first_token_time = now
        r.num_output_tokens += num_new
        m = self.metrics
        if m is None:
            return
        if num_new and r.num_output_tokens == num_new:
            m.ttft.observe(now - r.arrival_time)
        if part.finish_reason is not None:
            m.e2e.observe(now - r.arrival_time)
            m.output_len.observe(r.num_output_tokens)
            m.finished(part.finish_reason)
            if r.num_output_tokens > 1 and r.first_token_time is not None:
                m.tpot.observe((now - r.first_token_time) / (r.num_output_tokens - 1))

    def _engine_gone(self) -> None:
        if self._closing:
            return
        code = None
        if self.process is not None:
            self.process.join(1)
            code = self.process.exitcode
        self.exit_message = f"the engine process exited (exit code {code})"
        log.error("%s: failing %d running requests", self.exit_message, len(self._requests))
        requests, self._requests = list(self._requests.values()), {}
        for r in requests:
            with contextlib.suppress(Exception):
                r.sink.push(r.index, EngineDeadError(self.exit_message))
        if self.restart_engine and self.config is not None:
            log.error("starting a new engine process")
            threading.Thread(target=self._relaunch, name="nanoqwen-engine-restart").start()
        elif self.on_exit is not None:
            self.on_exit()

    def _relaunch(self) -> None:
        """In a thread: a new engine process, loaded, then swapped in on the event loop.
        Until then requests fail at once and /health answers 503."""
        try:
            inputs, outputs, process = spawn_engine(self.config, self.stream_interval)
        except Exception as e:
            self._call_soon(self._relaunch_failed, f"{self.exit_message}; restart: {e}")
            return
        try:
            wait_until_loaded(outputs, process)
        except Exception as e:
            process.kill()
            self._call_soon(self._relaunch_failed, f"{self.exit_message}; restart: {e}")
            return
        if not self._call_soon(self._swap_in, inputs, outputs, process):
            process.kill()  # the server is shutting down

    def _call_soon(self, fn, *args) -> bool:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed
            return False
        return True

    def _relaunch_failed(self, message: str) -> None:
        self.exit_message = message
        log.error("%s", message)
        if self.on_exit is not None:
            self.on_exit()

    def _swap_in(self, inputs: Connection, outputs: Connection, process: BaseProcess) -> None:
        if self._closing:
            process.kill()
            return
        self._sender.close(1.0)
        self._outputs.close()
        self._sender = BatchSender(inputs, "nanoqwen-engine-input")
        self._outputs, self.process = outputs, process
        self._stats, self._num_submitted = None, 0
        self.num_restarts += 1
        self.exit_message = None
        self.start(self._loop)
        log.info("the new engine process (pid %d) is serving", process.pid)
