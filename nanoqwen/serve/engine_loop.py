"""The engine loop: one thread owns the LLM and steps it while any request is live.

HTTP handlers (on the asyncio event loop) hand requests in through submit() and abort();
both only append to an inbox under a lock, so they never wait for a step. The thread takes
the inbox between steps (new requests join the running batch at the next step), and after
each step hands every request's new tokens and text to its handler (its sink, on the event
loop), with one loop.call_soon_threadsafe per step for all of them.

Waking a handler, encoding a chunk and writing it costs the event loop's thread tens of
microseconds, under the same GIL as the engine: with hundreds of streams, a handler per token
each step would keep that thread busy enough to slow the steps. stream_interval N hands a
request its tokens N at a time (the first token, and the last, at once), as SGLang's and vLLM's
--stream-interval do."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

from nanoqwen.runtime.engine import LLM, StreamChunk
from nanoqwen.runtime.sampling_params import SamplingParams
from nanoqwen.runtime.sequence import Sequence
from nanoqwen.serve.metrics import ServingMetrics

log = logging.getLogger("nanoqwen.serve")


class Sink(Protocol):
    def push(self, index: int, payload: StreamChunk | Exception) -> None: ...


@dataclass(eq=False)
class EngineRequest:
    """One sequence run for a handler: choice `index` of its response. sink.push(index, chunk)
    runs on `loop` as tokens are made, or sink.push(index, exception) if the engine failed."""

    prompt_ids: list[int]
    params: SamplingParams
    index: int
    sink: Sink
    loop: asyncio.AbstractEventLoop
    arrival_time: float = field(default_factory=time.perf_counter)
    seq: Sequence | None = None
    first_token_time: float | None = None
    num_output_tokens: int = 0


def _push_all(items: list[tuple[Sink, int, StreamChunk | Exception]]) -> None:
    for sink, index, payload in items:
        sink.push(index, payload)


class EngineLoop:
    def __init__(
        self, llm: LLM, metrics: ServingMetrics | None = None, stream_interval: int = 1
    ) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval={stream_interval} is out of range: allowed >= 1")
        self.llm = llm
        self.metrics = metrics
        self.stream_interval = stream_interval
        self._lock = threading.Lock()
        self._inbox: list[tuple[str, list[EngineRequest]]] = []
        self._inbox_adds = 0
        self._wake = threading.Event()
        self._live: dict[int, EngineRequest] = {}  # seq_id -> request
        self._num_waiting = 0  # the scheduler's queue after the last step
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="nanoqwen-engine", daemon=True)
        self.steps = 0

    # ---- called from the HTTP side ----------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Sequences not yet running: in the scheduler's queue or not yet taken in."""
        return self._num_waiting + self._inbox_adds

    def submit(self, requests: list[EngineRequest]) -> None:
        with self._lock:
            self._inbox.append(("add", requests))
            self._inbox_adds += len(requests)
        self._wake.set()

    def abort(self, requests: list[EngineRequest]) -> None:
        """Ends the requests that are not finished; their KV blocks are free after the
        current step. Their sinks get nothing more."""
        with self._lock:
            self._inbox.append(("abort", requests))
        self._wake.set()

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            try:
                self._take_inbox()
                if not self._live:
                    self.llm.drain()  # a step still in flight holds only finished sequences
                    self._update_state()
                    self._wake.wait()
                    self._wake.clear()
                    continue
                resolved = self.llm.step()
                self.steps += 1
                self._deliver(resolved)
                self._update_state()
            except Exception as e:  # a bug or out of memory: fail what runs, keep serving
                log.exception("engine step failed")
                self._fail_all(e)

    def _take_inbox(self) -> None:
        with self._lock:
            items, self._inbox = self._inbox, []
            self._inbox_adds = 0
        failed: list[tuple[EngineRequest, Exception]] = []
        for kind, requests in items:
            for r in requests:
                if kind == "abort":
                    self._abort(r)
                    continue
                try:
                    r.seq = self.llm.add_request(r.prompt_ids, r.params)
                except Exception as e:  # the handler checked the request already
                    failed.append((r, e))
                    continue
                self._live[r.seq.seq_id] = r
                if self.metrics is not None:
                    self.metrics.prompt_tokens.inc(len(r.prompt_ids))
                    self.metrics.prompt_len.observe(len(r.prompt_ids))
        self._num_waiting = len(self.llm.scheduler.waiting)
        if failed:
            self._send([(r, e) for r, e in failed])

    def _abort(self, r: EngineRequest) -> None:
        if r.seq is None or r.seq.is_finished:
            return
        self.llm.abort([r.seq])
        self._live.pop(r.seq.seq_id, None)
        if self.metrics is not None:
            self.metrics.finished("abort")

    def _deliver(self, resolved: list[tuple[Sequence, int]]) -> None:
        now = time.perf_counter()
        out: list[tuple[EngineRequest, StreamChunk]] = []
        for seq, _ in resolved:
            r = self._live.get(seq.seq_id)
            if r is None:
                continue
            if (
                self.stream_interval > 1
                and r.first_token_time is not None
                and not seq.is_finished
                and len(seq.unstreamed or ()) < self.stream_interval
            ):
                continue  # kept on the sequence until the interval is full
            chunk = self.llm.take_output(seq)
            if chunk is None:
                continue
            if chunk.finished:
                del self._live[seq.seq_id]
            self._record(r, chunk, now)
            out.append((r, chunk))
        if out:
            self._send(out)

    def _record(self, r: EngineRequest, chunk: StreamChunk, now: float) -> None:
        if r.first_token_time is None and chunk.token_ids:
            r.first_token_time = now
        r.num_output_tokens += len(chunk.token_ids)
        m = self.metrics
        if m is None:
            return
        m.generation_tokens.inc(len(chunk.token_ids))
        if chunk.token_ids and r.num_output_tokens == len(chunk.token_ids):
            m.ttft.observe(now - r.arrival_time)
        if chunk.finished:
            m.e2e.observe(now - r.arrival_time)
            m.output_len.observe(r.num_output_tokens)
            m.finished(chunk.finish_reason or "length")
            if r.num_output_tokens > 1 and r.first_token_time is not None:
                m.tpot.observe((now - r.first_token_time) / (r.num_output_tokens - 1))

    def _send(self, items: list[tuple[EngineRequest, object]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for r, payload in items:
            by_loop[r.loop].append((r.sink, r.index, payload))
        for loop, batch in by_loop.items():
            # RuntimeError: that event loop is closed, the server is shutting down.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_push_all, batch)

    def _fail_all(self, error: Exception) -> None:
        requests = list(self._live.values())
        self._live.clear()
        self.llm.abort([r.seq for r in requests if r.seq is not None])
        try:
            self.llm.drain()
        except Exception:
            log.exception("engine drain failed")
        self._send([(r, error) for r in requests])

    def _update_state(self) -> None:
        sched = self.llm.scheduler
        self._num_waiting = len(sched.waiting)
        if self.metrics is not None:
            blocks = sched.blocks
            self.metrics.set_engine_state(
                len(sched.running),
                len(sched.waiting),
                blocks.num_free_blocks,
                blocks.num_blocks,
                sched.num_preemptions,
            )
