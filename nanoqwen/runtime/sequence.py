"""One request's tokens and progress as it moves through the scheduler."""

from __future__ import annotations

import enum
import itertools

from nanoqwen.errors import InvalidInputError
from nanoqwen.runtime.logprobs import TokenLogprobs
from nanoqwen.runtime.sampling_params import SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its blocks copied to the host pool
    FINISHED = "finished"


class Sequence:
    def __init__(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise InvalidInputError("prompt is empty: allowed at least one token", param="prompt")
        self.seq_id = next(_ids)
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        # Tokens whose K/V are in the cache; reset to 0 on preemption.
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prompt tokens the prefix cache held
        self.block_table: list[int] = []
        # Prefix-cache keys of its full blocks (they depend on the tokens only, so they
        # survive preemption), and how many leading blocks of block_table are registered.
        self.block_hashes: list[int] = []
        self.num_registered_blocks = 0
        self.host_block_table: list[int] = []  # its blocks while swapped out
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token or string that ended it
        # Tokens applied but not yet handed out by LLM.stream(); None when not streamed.
        self.unstreamed: list[int] | None = None
        self.num_streamed = 0  # tokens handed out by stream() / take_output()
        # The sampling noise's key: params.seed, or one drawn when the request first samples.
        self.sampling_seed: int | None = None
        # With params.logprobs / prompt_logprobs: one entry per output / prompt token.
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.prompt_logprobs_launched = 1  # the next prompt position whose entry is computed
        self.arrival_time = 0.0
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.grammar = None  # structured output: its GrammarState (sampling/structured.py)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
