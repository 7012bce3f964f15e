"""nanoqwen vs HF transformers on the same random weights of real Qwen2.5 shapes."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.bench_hf import hf_model_from
from nanoqwen.runtime.scheduler import Batch
from nanoqwen.runtime.sequence import Sequence

NEW_TOKENS = 48
# Logit margin above which bf16 rounding (measured well under 0.05 here) cannot flip a token.
CLEAR_MARGIN = 0.1


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10000) for _ in range(rng.randint(8, 200))] for _ in range(n)]


@torch.inference_mode()
def teacher_forced_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """nanoqwen's logits at every position of token_ids, in one prefill."""
    seq = Sequence(token_ids, SamplingParams())
    llm.scheduler.blocks.grow(seq, len(seq))
    try:
        batch = Batch([seq], True, [len(seq)])
        ids, meta, _ = llm.runner.prepare_prefill(batch)
        x, residual = llm.runner.model(ids, meta)
        return llm.runner.model.compute_logits((x, residual))
    finally:
        llm.scheduler.blocks.free(seq)


@pytest.mark.parametrize("shape", ["0.5B", "1.5B"])
def test_bf16_fidelity(shape):
    llm = LLM(
        random_shape=shape,
        device="cuda",
        dtype="bfloat16",
        num_kv_blocks=64,
        max_num_seqs=8,
        progress=False,
    )
    hf = hf_model_from(llm)
    stats = []
    for prompt in _prompts(4, seed=1):
        ids = torch.tensor([prompt], device="cuda")
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
        )
        hf_tokens = out.sequences[0, len(prompt) :].tolist()
        hf_logits = torch.cat(out.logits).float()  # [NEW_TOKENS, vocab]
        ours = teacher_forced_logits(llm, prompt + hf_tokens[:-1])[len(prompt) - 1 :]
        assert ours.shape == hf_logits.shape
        our_top5 = ours.topk(5).indices
        hf_top5 = hf_logits.topk(5).indices
        for t, tok in enumerate(hf_tokens):
            assert tok in our_top5[t], f"step {t}: HF's token not in nanoqwen's top-5"
            assert our_top5[t, 0] in hf_top5[t], f"step {t}: nanoqwen's token not in HF's top-5"
        diff = (
            (ours.log_softmax(-1) - hf_logits.log_softmax(-1))
            .gather(1, torch.tensor(hf_tokens, device="cuda").unsqueeze(1))
            .abs()
        )
        assert diff.max().item() < 0.1, f"logprob difference {diff.max().item():.3f}"
        top2 = hf_logits.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > CLEAR_MARGIN
        agree = our_top5[:, 0] == torch.tensor(hf_tokens, device="cuda")
        assert bool(agree[clear].all()), "a clearly-decided token differs from HF"
        # Free-running generation agrees with HF until the first unclear step.
        free = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        )[0].token_ids
        first_unclear = int((~clear).nonzero()[0]) if not bool(clear.all()) else NEW_TOKENS
        assert free[:first_unclear] == hf_tokens[:first_unclear]
        stats.append((diff.max().item(), clear.float().mean().item(), first_unclear))
    print(f"{shape}: (max logprob diff, clear fraction, agreeing prefix) per prompt: {stats}")
    del llm, hf
    gc.collect()
    torch.cuda.empty_cache()


def test_float32_token_exact_with_torch_backend():
    llm = LLM(
        random_shape="0.5B",
        device="cuda",
        dtype="float32",
        attention_backend="torch",
        block_size=16,
        num_kv_blocks=256,
        max_num_seqs=4,
        enforce_eager=True,
        progress=False,
    )
    hf = hf_model_from(llm)
    prompts = _prompts(4, seed=2)
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, ours):
        ids = torch.tensor([prompt], device="cuda")
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=32,
            min_new_tokens=32,
        )[0, len(prompt) :].tolist()
        assert out.token_ids == ref
    del llm, hf
    gc.collect()
    torch.cuda.empty_cache()
