"""Rank 0's ModelRunner under tensor parallelism: every step's inputs go to the other ranks
in one message before rank 0 runs its own part of the step."""

from __future__ import annotations

import atexit

import torch

from nanoqwen.runtime.kv.host_pool import HostKVCache
from nanoqwen.runtime.launched_step import LaunchedStep
from nanoqwen.runtime.model_runner import ModelRunner
from nanoqwen.runtime.parallel.group import TensorParallelError, leave_group, release_graphs
from nanoqwen.runtime.parallel.message import (
    Field,
    Op,
    StepChannel,
    encode_copies,
    header,
    step_header,
)
from nanoqwen.runtime.parallel.processes import WorkerProcesses, sigint_deferred
from nanoqwen.runtime.step_buffer import StepBuffer
from nanoqwen.runtime.step_inputs import StepInputs


class RecordingHostKVCache(HostKVCache):
    """Rank 0's host KV pool: copies as usual, and remembers them so the other ranks repeat
    them on their own KV shards before the next step."""

    def __init__(self, device_cache, num_blocks: int) -> None:
        super().__init__(device_cache, num_blocks)
        self.pending: list[tuple[int, list[int], list[int]]] = []

    def copy_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        super().copy_out(device_blocks, host_blocks)
        self.pending.append((0, list(device_blocks), list(host_blocks)))

    def copy_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        super().copy_in(host_blocks, device_blocks)
        self.pending.append((1, list(host_blocks), list(device_blocks)))

    def take(self) -> list[int]:
        ints, self.pending = encode_copies(self.pending), []
        return ints


class ParallelModelRunner(ModelRunner):
    def __init__(
        self,
        model,
        kv_cache,
        block_manager,
        sampler,
        graphs,
        prefill_graphs,
        channel: StepChannel,
        workers: WorkerProcesses | None,
    ) -> None:
        super().__init__(model, kv_cache, block_manager, sampler, graphs, prefill_graphs)
        self.channel = channel
        self.workers = workers  # None under torchrun, whose agent watches the ranks
        self.host = block_manager.host
        self.failure: str | None = None
        atexit.register(self.close)

    def _copies(self) -> list[int]:
        return self.host.take() if isinstance(self.host, RecordingHostKVCache) else []

    def upload(self, inputs: StepInputs):
        h = step_header(inputs)
        h[Field.PROMPT_ROWS] = len(inputs.prompt_rows)
        extra = [v for r in inputs.prompt_rows for v in r] + self._copies()
        self.channel.send(h, extra)
        return super().upload(inputs)

    def _sent(self, buffer: StepBuffer, inputs: StepInputs) -> None:
        super()._sent(buffer, inputs)  # placeholders filled: the others get the ids
        self.channel.share(buffer.dev)

    def _announce_graph(self, key) -> None:
        bs, variant, filtering, cascade = key
        h = header(
            Op.GRAPH, graph_bs=bs, graph_variant=variant, graph_filtering=filtering,
            graph_cascade=cascade,
        )  # fmt: skip
        self.channel.send(h, self._copies())

    def _announce_prefill_graph(self, key) -> None:
        bucket, rows, filtering = key
        h = header(Op.PREFILL_GRAPH, graph_bs=bucket, graph_variant=rows, graph_filtering=filtering)
        self.channel.send(h, self._copies())

    # ---- failure and shutdown ---------------------------------------------------------------
    def _all_reduce_failed(self) -> str | None:
        custom = self.model.tp.custom_all_reduce
        return custom.error() if custom is not None else None

    def _guarded(self, run, *args):
        reason = self.failure is None and self._all_reduce_failed()
        if reason:  # an earlier step's all-reduce gave up: its results were void
            self._fail(reason)
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        with sigint_deferred():
            try:
                return run(*args)
            except Exception as e:
                reason = self.workers.dead(timeout=5.0) if self.workers else None
                # No rank died: this rank's own step failed (a collective, or out of memory),
                # and the others are left inside it.
                self._fail(reason or f"a step failed on rank 0 ({type(e).__name__}: {e})")
                raise TensorParallelError(self.failure) from e

    def execute(self, batch, sample_later: bool = False):
        return self._guarded(super().execute, batch, sample_later)

    def prompt_logits(self, token_ids, last=None):
        return self._guarded(super().prompt_logits, token_ids, last)

    def launch(self, batch) -> LaunchedStep:
        step = super().launch(batch)
        if self.workers is not None:  # used once the step has a `done` event to wait on
            step.watch = self._watch
        return step

    def _watch(self) -> None:
        """Called while rank 0 waits for a step on the GPU: a dead rank would leave it
        waiting forever (NCCL waits for a peer that never comes)."""
        reason = self.workers.dead() or self._all_reduce_failed()
        if reason is not None:
            self._fail(reason)
            raise TensorParallelError(self.failure)

    def _fail(self, reason: str) -> None:
        self.failure = f"{reason}; the tensor-parallel engine is shut down"
        self._leave_alone()
        atexit.unregister(self.close)

    def _leave_alone(self) -> None:
        """Ends the other ranks and aborts the group: destroying it with a peer gone blocks."""
        if self.workers is not None:
            self.workers.stop(timeout=0)
        self._release_graphs()
        leave_group()

    def _release_graphs(self) -> None:
        release_graphs(self)

    def close(self) -> None:
        """Stops the other ranks and leaves the group with them (idempotent)."""
        if self.failure is not None:
            return
        self.failure = "the engine was closed"
        atexit.unregister(self.close)
        try:
            self.channel.send(header(Op.SHUTDOWN), [])
        except Exception:  # noqa: BLE001  (a rank already gone)
            self._leave_alone()
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._release_graphs()
        leave_group(self.channel.ctx.control)
        if self.workers is not None:
            self.workers.stop()
