"""nanoqwen vs HF transformers on the same random weights of real Qwen2.5 shapes."""

from __future__ import annotations

import gc
import random
import sys

import pytest
import torch

from nanoqwen import LLM, SamplingParams
from nanoqwen.bench.hf import hf_model_from

NEW_TOKENS = 48
# bf16 logits near 4 are resolved to 0.03; HF against itself differs by up to 0.06 here.
MAX_LOGPROB_GAP = 0.15
# Logit margin above which bf16 rounding (measured well under 0.05 here) cannot flip a token.
CLEAR_MARGIN = 0.1


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10000) for _ in range(rng.randint(8, 200))] for _ in range(n)]


def logprob_gap(a: torch.Tensor, b: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """|log p_a(token) - log p_b(token)| at each row."""
    la, lb = a.log_softmax(-1), b.log_softmax(-1)
    return (la - lb).gather(1, tokens.unsqueeze(1)).abs().squeeze(1)


@pytest.mark.parametrize("shape", ["0.5B", "1.5B"])
@pytest.mark.parametrize(
    "block_size", [256, 16], ids=["block256", "block16-no-flash-attn"]
)  # the default backend: triton, with flash-attn's kernels inside at 256 where installed
def test_bf16_fidelity(shape, block_size, monkeypatch):
    if block_size != 256:
        monkeypatch.setitem(sys.modules, "flash_attn", None)
    llm = LLM(
        random_shape=shape,
        device="cuda",
        dtype="bfloat16",
        block_size=block_size,
        num_kv_blocks=64 * 256 // block_size,
        max_num_seqs=8,
        progress=False,
    )
    assert llm.runner.model.layers[0].self_attn.backend.name == "triton"
    hf = hf_model_from(llm)
    failures = []
    for p, prompt in enumerate(_prompts(4, seed=1)):
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
        hf_tok = torch.tensor(hf_tokens, device="cuda")
        hf_logits = torch.cat(out.logits).float()  # [NEW_TOKENS, vocab], HF's decode path
        ours = llm.runner.prompt_logits(prompt + hf_tokens[:-1], last=NEW_TOKENS)
        # HF against itself (one prefill vs step-by-step decode): the bf16 noise floor.
        with torch.no_grad():
            hf_prefill = hf(out.sequences[:, :-1]).logits[0, len(prompt) - 1 :].float()
        assert ours.shape == hf_logits.shape == hf_prefill.shape

        gap = logprob_gap(ours, hf_logits, hf_tok)
        noise = logprob_gap(hf_prefill, hf_logits, hf_tok)
        our_top5 = ours.topk(5).indices
        top2 = hf_logits.topk(2).values
        margin = top2[:, 0] - top2[:, 1]
        clear = margin > CLEAR_MARGIN
        print(
            f"{shape} prompt {p}: max logprob gap {gap.max():.4f} (HF self-noise "
            f"{noise.max():.4f}), min margin {margin.min():.4f}, clear {int(clear.sum())}/"
            f"{NEW_TOKENS}"
        )
        # Each one's top token in the other's top 5, by value, where tokens that beat it by
        # less than CLEAR_MARGIN do not count: on a flat top (random weights) more than five
        # logits can lie within bf16 rounding of each other.
        our_5th, hf_5th = ours.topk(5).values[:, -1], hf_logits.topk(5).values[:, -1]
        for t, tok in enumerate(hf_tokens):
            ours_top1 = int(our_top5[t, 0])
            if (
                ours[t, tok] + CLEAR_MARGIN < our_5th[t]
                or hf_logits[t, ours_top1] + CLEAR_MARGIN < hf_5th[t]
            ):
                rank = int((ours[t] > ours[t, tok]).sum())
                failures.append(
                    f"prompt {p} step {t}: HF token rank {rank} in nanoqwen, "
                    f"margin {margin[t]:.4f}, gap {gap[t]:.4f}, noise {noise[t]:.4f}"
                )
        if gap.max() >= MAX_LOGPROB_GAP:
            failures.append(f"prompt {p}: logprob gap {gap.max():.4f}")
        if not bool((our_top5[:, 0] == hf_tok)[clear].all()):
            failures.append(f"prompt {p}: a clearly-decided token differs from HF")
        # Free-running generation agrees with HF until the first unclear step.
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        free = llm.generate([prompt], params)[0].token_ids
        first_unclear = NEW_TOKENS if bool(clear.all()) else int((~clear).nonzero()[0])
        if free[:first_unclear] != hf_tokens[:first_unclear]:
            failures.append(f"prompt {p}: free-running tokens differ before step {first_unclear}")
    del llm, hf
    gc.collect()
    torch.cuda.empty_cache()
    assert not failures, "\n".join(failures)


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
