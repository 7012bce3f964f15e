"""DraftProposer: a second, cheaper Qwen2.5 model (a smaller one, or the same one quantized)
proposes tokens by greedy decoding over its own paged KV cache, whose sequences follow the
target's: each step they take in the tokens the target accepted, keep the K/V of the prefix
both agree on, and decode up to k tokens ahead."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nanoqwen.errors import InvalidInputError
from nanoqwen.runtime.builder import build_engine, capture_logits_graphs, log
from nanoqwen.runtime.launched_step import PLACEHOLDER
from nanoqwen.runtime.sampling_params import SamplingParams
from nanoqwen.runtime.scheduler import Batch
from nanoqwen.runtime.sequence import Sequence
from nanoqwen.runtime.spec.config import SpeculativeConfig

if TYPE_CHECKING:
    from nanoqwen.runtime.builder import EngineParts
    from nanoqwen.runtime.config import EngineConfig

GREEDY = SamplingParams(temperature=0)
MAX_STEP_TOKENS = 8192  # tokens one draft step feeds, over all its sequences


class DraftProposer:
    def __init__(self, spec: SpeculativeConfig, engine: EngineConfig, target: EngineParts):
        # As many blocks as the target's pool: the draft's sequences are the target's.
        config = type(engine)(
            model=spec.model, device=engine.device, dtype=engine.dtype,
            block_size=engine.block_size, num_kv_blocks=target.scheduler.blocks.num_blocks,
            max_num_seqs=engine.max_num_seqs, enforce_eager=True,  # its graphs: below
            enable_prefix_caching=False, swap_space=0, progress=False,
        )  # fmt: skip
        try:
            parts = build_engine(config)
        except torch.cuda.OutOfMemoryError:
            # The model sized its KV pool from gpu_memory_utilization first.
            raise InvalidInputError(
                f"speculative_config.model={spec.model!r} does not fit on the GPU beside the "
                f"model (gpu_memory_utilization={engine.gpu_memory_utilization}): allowed a "
                "lower gpu_memory_utilization, which leaves the draft its weights and a KV "
                "pool of as many blocks as the model's",
                param="speculative_config",
            ) from None
        mine, theirs = parts.tokenizer, target.tokenizer
        if mine is not None and theirs is not None and mine.vocab() != theirs.vocab():
            raise InvalidInputError(
                f"speculative_config.model={spec.model!r} has another tokenizer than the "
                "model: allowed a draft model with the same tokenizer",
                param="speculative_config",
            )
        if not engine.enforce_eager:
            capture_logits_graphs(parts)
        if engine.progress:
            log(
                f"draft model: {spec.model} ({parts.config.num_parameters() / 1e9:.2f}B parameters)"
            )
        self.runner = parts.runner
        self.blocks = parts.scheduler.blocks
        self.max_len = parts.max_model_len
        # Proposals are target token ids: the draft's extra vocabulary rows, if any, never win.
        self.vocab = min(target.config.vocab_size, parts.config.vocab_size)
        self.seqs: dict[int, Sequence] = {}  # target seq_id -> the draft's copy
        self.synced: dict[int, int] = {}  # target seq_id -> its length at the last sync

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        running = {s.seq_id for s in seqs}
        for seq_id in [i for i in self.seqs if i not in running]:
            self._drop(seq_id)  # finished or preempted: a preempted one starts over
        work = []  # (row, draft sequence, tokens to propose)
        for row, (seq, limit) in enumerate(zip(seqs, limits)):
            limit = min(limit, self.max_len - len(seq))
            if limit <= 0:
                continue
            draft = self._follow(seq)
            # It writes K/V up to its last proposal but one.
            if not self.blocks.can_grow(draft, len(seq) + limit - 1):
                self._drop(seq.seq_id)
                continue
            self.blocks.grow(draft, len(seq) + limit - 1)
            work.append((row, draft, limit))
        made: list[torch.Tensor] = []  # each step's tokens, left on the device
        spots: list[tuple[int, Sequence, int]] = []  # (row, draft, position) of each, in order
        counts = [0] * len(seqs)
        while work:
            # A token in flight always goes in; new sequences' prompts share MAX_STEP_TOKENS.
            budget, fed = MAX_STEP_TOKENS, []
            for _, draft, _ in work:
                need = len(draft) - draft.num_computed_tokens
                fed.append(need if need == 1 else min(need, max(budget, 0)))
                budget -= fed[-1]
            batch = Batch([d for (_, d, _), n in zip(work, fed) if n], True, [n for n in fed if n])
            tokens = self.runner.last_logits(batch)[:, : self.vocab].argmax(-1)
            done, ahead = [], []
            for (row, draft, limit), n in zip(work, fed):
                draft.num_computed_tokens += n
                if n and draft.num_computed_tokens == len(draft):
                    # Read back below; meanwhile the next step takes it from the device.
                    draft.token_ids.append(PLACEHOLDER)
                    done.append(draft)
                    spots.append((row, draft, len(draft) - 1))
                    counts[row] += 1
                if counts[row] < limit:
                    ahead.append((row, draft, limit))
            self.runner.keep_last(tokens, done)
            made.append(tokens)
            work = ahead
        proposals: list[list[int]] = [[] for _ in seqs]
        # The proposals' one wait for the device.
        for (row, draft, pos), token in zip(spots, torch.cat(made).tolist() if made else []):
            draft.token_ids[pos] = token
            proposals[row].append(token)
        return proposals

    def _follow(self, seq: Sequence) -> Sequence:
        """The draft's copy of seq with seq's tokens: K/V kept for the prefix that both
        agree on (what the target accepted of the last proposals)."""
        draft = self.seqs.get(seq.seq_id)
        if draft is None:
            draft = self.seqs[seq.seq_id] = Sequence(list(seq.token_ids), GREEDY)
            self.synced[seq.seq_id] = len(seq)
            return draft
        same = self.synced[seq.seq_id]  # the target's tokens before it never change
        end = min(len(draft.token_ids), len(seq.token_ids))
        while same < end and draft.token_ids[same] == seq.token_ids[same]:
            same += 1
        draft.num_computed_tokens = min(draft.num_computed_tokens, same, len(seq) - 1)
        draft.token_ids[same:] = seq.token_ids[same:]
        self.synced[seq.seq_id] = len(seq)
        return draft

    def release(self, seq: Sequence) -> None:
        """seq stopped running (finished, retired or preempted): its copy's blocks go back."""
        if seq.seq_id in self.seqs:
            self._drop(seq.seq_id)

    def _drop(self, seq_id: int) -> None:
        self.blocks.free(self.seqs.pop(seq_id))
        del self.synced[seq_id]
