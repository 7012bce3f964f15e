"""The engine process: owns the LLM (model, scheduler, sampler, CUDA context) and loops
take inputs -> step -> send outputs, apart from the HTTP process and its GIL.

The loop reads the batched AddRequest / AbortRequest lists between steps (new requests join
the running batch at the next step) and hands each step's output, every request's new tokens
and text in one StepOutputs, to a BatchSender: it never waits for the HTTP process. With
nothing to run it blocks on the input pipe; the pipe closing (the HTTP process exited, however
it ended) ends the loop, and so the process.

stream_interval N hands a request its tokens N at a time (the first token, and the last, at
once), as SGLang's and vLLM's --stream-interval do: fewer, larger chunks for the HTTP process
to write."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection

import torch

from nanoqwen.errors import debug, exit_code, one_line
from nanoqwen.runtime.config import EngineConfig
from nanoqwen.runtime.engine import LLM
from nanoqwen.runtime.parallel.group import TensorParallelError
from nanoqwen.runtime.sampling_params import SamplingParams
from nanoqwen.serve.batch_sender import BatchSender, receive
from nanoqwen.serve.messages import (
    AbortRequest,
    AddRequest,
    EngineReady,
    EngineStartupError,
    EngineStats,
    OutputRow,
    RowExtras,
    Shutdown,
    StepOutputs,
)

log = logging.getLogger("nanoqwen.serve")


class EngineCore:
    def __init__(self, llm: LLM, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval={stream_interval} is out of range: allowed >= 1")
        self.llm = llm
        self.stream_interval = stream_interval
        self._live: dict[int, int] = {}  # seq_id -> request id
        self._seqs: dict[int, object] = {}  # request id -> Sequence
        self.num_added = 0
        self.steps = 0
        # A failure no later step can get past (a tensor-parallel rank died): the loop ends
        # and the process exits 1, so the server stops and its supervisor starts anew.
        self.fatal: Exception | None = None

    @property
    def has_work(self) -> bool:
        return bool(self._live)

    def apply(self, items: list, out: StepOutputs) -> bool:
        """Takes in one batch from the HTTP process; False once told to shut down."""
        for item in items:
            if isinstance(item, AddRequest):
                self.num_added += 1
                try:
                    seq = self.llm.add_request(item.prompt_ids, item.params)
                except Exception as e:  # the HTTP side checked the request already
                    out.failed.append((item.request_id, str(e)))
                    continue
                if self._direct(item.params):
                    seq.unstreamed = None  # its tokens come from step()'s result
                self._live[seq.seq_id] = item.request_id
                self._seqs[item.request_id] = seq
            elif isinstance(item, AbortRequest):
                seq = self._seqs.pop(item.request_id, None)
                if seq is not None:
                    self._live.pop(seq.seq_id, None)
                    self.llm.abort([seq])
            elif isinstance(item, Shutdown):
                return False
        return True

    def step(self, out: StepOutputs) -> None:
        """One engine step; a step that raises (a bug, out of device memory) fails the
        requests that were running and leaves the engine empty, ready for more."""
        try:
            resolved = self.llm.step()
            self.steps += 1
        except Exception as e:
            log.exception("engine step failed")
            self._fail_all(e, out)
            if isinstance(e, TensorParallelError):
                self.fatal = e
            return
        live, ids, tokens, texts = self._live, out.request_ids, out.token_ids, out.texts
        for seq, token in resolved:
            request_id = live.get(seq.seq_id)
            if request_id is None:
                continue
            if seq.unstreamed is None:  # a direct request: its token is all there is
                if seq.is_finished:
                    del live[seq.seq_id]
                    del self._seqs[request_id]
                    extras = RowExtras(cached_tokens=seq.num_cached_tokens or 0)
                    out.rows.append((request_id, "", [token], True, seq.finish_reason, None,
                                     extras))  # fmt: skip
                else:
                    ids.append(request_id)
                    tokens.append(token)
                    texts.append("")
                continue
            if (
                self.stream_interval > 1
                and seq.num_streamed > 0
                and not seq.is_finished
                and len(seq.unstreamed) < self.stream_interval
            ):
                continue  # kept on the sequence until the interval is full
            chunk = self.llm.take_output(seq)
            if chunk is None:
                continue
            extras = None
            if seq.params.prompt_logprobs is not None and seq.num_streamed == len(
                chunk.token_ids
            ):  # its first output
                extras = RowExtras(prompt_logprobs=seq.prompt_logprobs)
            if chunk.finished:
                del live[seq.seq_id]
                del self._seqs[request_id]
                extras = extras or RowExtras()
                extras.cached_tokens = seq.num_cached_tokens or 0
            elif chunk.logprobs is None and len(chunk.token_ids) == 1 and extras is None:
                ids.append(request_id)
                tokens.append(chunk.token_ids[0])
                texts.append(chunk.text)
                continue
            row: OutputRow = (
                request_id, chunk.text, chunk.token_ids, chunk.finished, chunk.finish_reason,
                chunk.logprobs, extras,
            )  # fmt: skip
            out.rows.append(row)

    def _direct(self, params: SamplingParams) -> bool:
        """Whether a request's output is its tokens alone, taken straight from step()'s
        result rather than through take_output(): no text (no tokenizer, as with random
        weights), no logprobs, no interval to wait for."""
        return (
            self.llm.tokenizer is None
            and params.logprobs is None
            and params.prompt_logprobs is None
            and self.stream_interval == 1
        )

    def idle(self) -> None:
        """Applies the step still in flight (it holds only finished sequences by now)."""
        self.llm.drain()

    def stats(self) -> EngineStats:
        sched = self.llm.scheduler
        spec = self.llm.speculator.stats if self.llm.speculator is not None else None
        return EngineStats(
            len(sched.running),
            len(sched.waiting),
            sched.blocks.num_free_blocks,
            sched.blocks.num_blocks,
            sched.num_preemptions,
            self.num_added,
            *((spec.num_verified, spec.num_proposed, spec.num_accepted) if spec else ()),
        )

    def _fail_all(self, error: Exception, out: StepOutputs) -> None:
        seqs = list(self._seqs.values())
        out.failed += [(request_id, str(error)) for request_id in self._seqs]
        self._live.clear()
        self._seqs.clear()
        self.llm.abort(seqs)
        try:
            self.llm.drain()
        except Exception:
            log.exception("engine drain failed")

    def serve(self, inputs: Connection, outputs: Connection) -> None:
        """The loop, until Shutdown or either pipe closes; closes `outputs` when done."""
        sender = BatchSender(outputs, "nanoqwen-engine-sender")
        last_stats = None
        try:
            while not sender.broken:
                if not self._live:
                    self.idle()
                    stats = self.stats()
                    if stats != last_stats:  # the last requests' blocks are free now
                        sender.put(StepOutputs(stats=stats))
                        last_stats = stats
                    inputs.poll(None)  # nothing to run: sleep until the HTTP side speaks
                out = StepOutputs()
                while inputs.poll(0):
                    if not self.apply(receive(inputs), out):
                        return
                if self._live:
                    self.step(out)
                out.stats = last_stats = self.stats()
                sender.put(out)
                if self.fatal is not None:
                    return
        except (EOFError, OSError):  # the HTTP process is gone
            return
        finally:
            sender.close()


def engine_main(
    config: EngineConfig, stream_interval: int, inputs: Connection, outputs: Connection
) -> None:
    """The engine process's entry point (started with the spawn context)."""
    # Ctrl-C in a terminal reaches the whole process group: the HTTP process handles it and
    # ends this process by closing the pipe, so this one must not die of it first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(format="%(levelname)s:     %(message)s")
    if "OMP_NUM_THREADS" not in os.environ:
        # A core for the HTTP process, busy while clients stream: torch's CPU threads wait
        # for each other at every op, so one of them descheduled stalls them all (a model on
        # the CPU runs several times slower when they are as many as the cores).
        torch.set_num_threads(max(1, torch.get_num_threads() - 1))

    try:
        llm = LLM(config=config)
        core = EngineCore(llm, stream_interval)
    except Exception as e:
        if debug():
            traceback.print_exc()
        code, message = exit_code(e), one_line(e)
        with contextlib.suppress(OSError):  # unless the HTTP process is gone already
            outputs.send(EngineStartupError(message, code))
        return
    # The loaded engine's objects are there for good: a full collection that walked them
    # all (~100 ms with torch's) would stall a step.
    gc.collect()
    gc.freeze()
    ready = EngineReady(llm.max_model_len, llm.config.vocab_size)
    try:
        outputs.send(ready)
    except OSError:  # the HTTP process is gone already
        return
    core.serve(inputs, outputs)
    if core.fatal is not None:
        sys.exit(1)
