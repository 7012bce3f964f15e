"""LLM: the public engine. Owns the model, KV pool, scheduler and runner; drives steps."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from collections.abc import Sequence as SequenceOf
from dataclasses import fields

from tqdm import tqdm

from nanoqwen.errors import InvalidInputError
from nanoqwen.runtime.builder import EngineParts, build_engine
from nanoqwen.runtime.chat.output import ChatOutput, chat_output
from nanoqwen.runtime.chat.request import chat_request, constrained, conversations
from nanoqwen.runtime.config import EngineConfig
from nanoqwen.runtime.launched_step import PLACEHOLDER, LaunchedStep
from nanoqwen.runtime.output_processor import OutputProcessor
from nanoqwen.runtime.outputs import RequestOutput, StreamChunk
from nanoqwen.runtime.sampling.structured import GrammarCompiler
from nanoqwen.runtime.sampling_params import SamplingParams
from nanoqwen.runtime.sequence import Sequence
from nanoqwen.runtime.spec.proposers import make_proposer
from nanoqwen.runtime.spec.speculator import Speculator
from nanoqwen.validation import (
    check_prompt_length,
    encode_prompt,
    split_prompts,
    split_sampling_params,
    token_ids,
)

Prompt = str | list[int]


class LLM:
    """Usage: LLM("path/or/hub-id").generate(["Hello"], SamplingParams(temperature=0))."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        config: EngineConfig | None = None,
        **options,
    ) -> None:
        """Every option is a field of EngineConfig (runtime/config.py), given here by name
        or as a whole config; options override the config's fields.

        tensor_parallel_size N > 1 splits the model over N processes (one GPU each, or CPU
        processes with gloo) that this call starts; close() stops them. Under torchrun
        (N ranks), rank 0 returns from here and the other ranks serve it until it closes."""
        if config is not None:
            options = {f.name: getattr(config, f.name) for f in fields(config)} | options
        if model is not None:
            options["model"] = model
        self.engine_config = EngineConfig.of(**options)
        parts: EngineParts = build_engine(self.engine_config)
        self.parts = parts
        self.config = parts.config
        self.tokenizer = parts.tokenizer
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.max_model_len = parts.max_model_len
        self.output_processor = OutputProcessor(
            self.scheduler, self.tokenizer, parts.eos_token_ids, self.max_model_len
        )
        self._launched: LaunchedStep | None = None
        self._grammars: GrammarCompiler | None = None  # at the first structured request
        spec = self.engine_config.speculative_config
        self.speculator = None
        if spec is not None:
            proposer = make_proposer(spec, self.engine_config, parts)
            on_gpu = self.runner.device.type == "cuda"
            speculator = Speculator(spec, self.max_model_len, proposer, backs_off=on_gpu)
            self.speculator = speculator
            release_slot = self.scheduler.on_release

            def release(seq: Sequence) -> None:
                release_slot(seq)
                speculator.release(seq)

            self.scheduler.on_release = release
            self.scheduler.propose = self.speculator.propose

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that end a request (unless ignore_eos)."""
        return self.output_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.output_processor.eos_token_ids = ids

    # ---- requests -------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids; InvalidInputError for anything but a str or token ids."""
        return encode_prompt(prompt, self.tokenizer, self.config.vocab_size)

    def _add(self, prompt: Prompt, params: SamplingParams, detokenize: bool) -> Sequence:
        ids = self.encode(prompt)
        check_prompt_length(len(ids), self.max_model_len)
        token_ids("stop_token_ids", params.stop_token_ids, self.config.vocab_size)
        if params.logit_bias:
            token_ids("logit_bias", sorted(params.logit_bias), self.config.vocab_size)
        seq = Sequence(ids, params)
        if params.structured_output is not None:
            seq.grammar = self._grammar_compiler().compile(params.structured_output)
        seq.arrival_time = time.perf_counter()
        self.output_processor.track(seq, detokenize)
        self.scheduler.add(seq)
        return seq

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            if self.tokenizer is None:
                raise InvalidInputError(
                    "structured_output needs the model's tokenizer, and this engine has none "
                    "(random weights)",
                    param="structured_output",
                )
            self._grammars = GrammarCompiler(
                self.tokenizer, self.config.vocab_size, self.eos_token_ids
            )
        return self._grammars

    def _add_all(self, prompts, sampling_params, detokenize: bool) -> list[Sequence]:
        prompts = split_prompts(prompts)
        params = split_sampling_params(sampling_params, len(prompts), SamplingParams)
        seqs: list[Sequence] = []
        try:
            for p, sp in zip(prompts, params):
                seqs.append(self._add(p, sp, detokenize))
        except BaseException:
            self.abort(seqs)  # a bad prompt leaves none of the earlier ones queued
            raise
        return seqs

    # ---- stepping -------------------------------------------------------------------------
    def _launch(self, batch) -> LaunchedStep:
        launched = self.runner.launch(batch)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        reaches_length_limit = self.output_processor.reaches_length_limit
        for seq in launched.seqs:
            seq.token_ids.append(PLACEHOLDER)
            if reaches_length_limit(seq, len(seq)):
                # It ends with this token whatever the token is: schedule it no further.
                self.scheduler.retire(seq)
        return launched

    def _resolve(self) -> list[tuple[Sequence, int]]:
        """Reads back the launched step's tokens and applies them. Returns (sequence, token)
        for each live sequence."""
        launched, self._launched = self._launched, None
        return [] if launched is None else self.output_processor.apply_launched(launched)

    def _verify(self, batch) -> list[tuple[Sequence, int]]:
        """Runs a decode step with proposals and applies each sequence's accepted tokens."""
        verified = self.runner.verify(batch)
        self.speculator.count(verified, batch.seqs, batch.proposals)
        return self.output_processor.apply_verified(batch, verified)

    def step(self) -> list[tuple[Sequence, int]]:
        """Schedules and launches one step, then applies the previous step's tokens, so the
        host work of one step overlaps the device work of the next.

        Returns (sequence, new token) for the sequences whose token was applied."""
        if self.speculator is not None:
            return self._step_speculative()
        return self._step_ahead()

    def _step_ahead(self) -> list[tuple[Sequence, int]]:
        batch = self.scheduler.schedule()
        if batch is None:
            return self._resolve()
        launched = self._launch(batch)
        resolved = self._resolve()
        # A step with structured output samples only now: its masks need the tokens just read
        # back, which the host took in while the device ran this step's model.
        launched.complete()
        self._launched = launched
        return resolved

    def _step_speculative(self) -> list[tuple[Sequence, int]]:
        """Proposals follow a sequence's newest token, so a step that may propose reads the
        step in flight back before it is scheduled, and a verify step is waited for. A step
        that proposes nothing, and every step while each running sequence backs off from
        proposing (spec/speculator.py), runs one step ahead as a plain one does."""
        if not self.speculator.due(self.scheduler.running):
            self.speculator.holding = True
            try:
                return self._step_ahead()
            finally:
                self.speculator.holding = False
        resolved = self._resolve()  # a step still in flight: the proposals follow its tokens
        batch = self.scheduler.schedule()
        if batch is None:
            return resolved
        if batch.proposals is not None:
            return resolved + self._verify(batch)
        # Nothing proposed: this step runs ahead, as a plain one does; the next step() that
        # proposes reads it back first.
        launched = self._launch(batch)
        launched.complete()
        self._launched = launched
        return resolved

    def drain(self) -> list[tuple[Sequence, int]]:
        """Applies the step still in flight, if any."""
        return self._resolve()

    def abort(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if not seq.is_finished:
                while seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:
                    seq.token_ids.pop()
                self.scheduler.finish(seq, "abort")
                self.output_processor.forget(seq)

    # ---- public API -----------------------------------------------------------------------
    def close(self) -> None:
        """Stops the other tensor-parallel ranks (also done at exit); a no-op with one."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict[str, float]:
        """Counters since the engine started: prefix-cache queries and hits (tokens of
        admitted sequences, and of those the ones taken from the cache, host tier included),
        preemptions (swaps among them) and blocks copied to and from the host pool."""
        blocks = self.scheduler.blocks
        cache = blocks.stats
        return {
            "prefix_cache_queries": cache.queries,
            "prefix_cache_hits": cache.hits,
            "prefix_cache_hit_rate": cache.hit_rate,
            "prefix_cache_host_hits": cache.host_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swaps": self.scheduler.num_swaps,
            "blocks_swapped_out": blocks.host.blocks_out if blocks.host else 0,
            "blocks_swapped_in": blocks.host.blocks_in if blocks.host else 0,
        } | self._speculation_stats()

    def _speculation_stats(self) -> dict[str, float]:
        """With speculative decoding: proposed and accepted tokens, and what they come to."""
        if self.speculator is None:
            return {}
        s = self.speculator.stats
        return {
            "spec_verified": s.num_verified,
            "spec_proposed_tokens": s.num_proposed,
            "spec_accepted_tokens": s.num_accepted,
            "spec_acceptance_rate": s.acceptance_rate,
            "spec_mean_accepted_length": s.mean_accepted_length,
        }

    def generate(
        self,
        prompts: Prompt | SequenceOf[Prompt],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        seqs = self._add_all(prompts, sampling_params, detokenize=False)
        bar = tqdm(total=len(seqs), desc="Generating", unit="req", disable=not use_tqdm)
        try:
            done = 0
            while any(not s.is_finished for s in seqs):
                self.step()
                finished = sum(s.is_finished for s in seqs)
                bar.update(finished - done)
                done = finished
            self.drain()
        finally:
            bar.close()
            self.abort(seqs)  # only an exception leaves any unfinished
        return [self.output_processor.output(s) for s in seqs]

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        tools=None,
        tool_choice=None,
        parallel_tool_calls: bool = True,
        response_format=None,
        use_tqdm: bool = False,
    ) -> list[ChatOutput]:
        """Answers one conversation (a list of OpenAI-style messages) or a list of them
        through the checkpoint's chat template; tools, tool_choice, parallel_tool_calls and
        response_format as in OpenAI's chat API (runtime/chat/). Each ChatOutput holds the
        content, the tool calls read from the answer, and the raw RequestOutput."""
        requests = [
            chat_request(
                self.tokenizer, c, tools, tool_choice, parallel_tool_calls, response_format
            )  # fmt: skip
            for c in conversations(messages)
        ]
        params = split_sampling_params(sampling_params, len(requests), SamplingParams)
        params = [constrained(p, r) for p, r in zip(params, requests)]
        outputs = self.generate([r.prompt_ids for r in requests], params, use_tqdm)
        return [chat_output(o, r.tool_names) for o, r in zip(outputs, requests)]

    def stream(
        self,
        prompts: Prompt | SequenceOf[Prompt],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
    ) -> Iterator[StreamChunk]:
        """Yields each request's new text as it is produced; closing the iterator early
        (or Ctrl-C in the caller) aborts the unfinished requests."""
        seqs = self._add_all(prompts, sampling_params, detokenize=True)
        for seq in seqs:
            seq.unstreamed = []
        # Tokens are collected on each sequence, so none is lost when another generate() or
        # stream() call runs the engine while this iterator is paused.
        open_requests = set(range(len(seqs)))
        try:
            while open_requests:
                if any(not seqs[i].is_finished for i in open_requests):
                    self.step()
                for i in sorted(open_requests):
                    chunk = self.take_output(seqs[i], index=i)
                    if chunk is None:
                        continue
                    if chunk.finished:
                        open_requests.discard(i)
                    yield chunk
        finally:
            self.abort([s for s in seqs if not s.is_finished])

    # ---- request API for servers: the caller adds requests and drives step() ---------------
    def add_request(self, prompt: Prompt, params: SamplingParams) -> Sequence:
        """Queues one request; it runs in the next step() calls, and take_output() hands out
        its new tokens and text as they are made."""
        seq = self._add(prompt, params, detokenize=True)
        seq.unstreamed = []
        return seq

    def take_output(self, seq: Sequence, index: int = 0) -> StreamChunk | None:
        """The tokens and text seq made since the last call (the pieces join to exactly its
        final text, as in stream()), or None when there is nothing new. Once a chunk with
        finished=True is taken, seq is done with: it is not to be passed again."""
        return self.output_processor.take_output(seq, index)
