"""Fidelity against HF transformers on the real Qwen2.5-Coder-0.5B-Instruct checkpoint (CPU).

- float32: nanoqwen's greedy output for nine chat prompts, generated in one batch, is token
  for token HF's greedy `generate` run on each prompt alone (EOS as HF's generation config has
  it), and both tokenize the chat template identically.
- bfloat16: teacher-forced on HF-fp32's output, at every generated position HF-bf16's argmax
  is in nanoqwen-bf16's top 5 and vice versa (bf16 rounding differs between the two, so exact
  tokens are not expected), and the argmaxes agree at 99% of the positions or more.

Needs `python tools/make_qwen_coder.py` (skipped without it; CI sets
NANOQWEN_REQUIRE_REAL_MODEL=1 to fail instead). Deselect with -m "not real_model".
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import pytest
import torch
from conftest import REAL_MODEL_REPORT

from nanoqwen import LLM, SamplingParams

pytestmark = pytest.mark.real_model

NEW_TOKENS = 64
TOP_K = 5
# bf16 argmaxes of nanoqwen and HF agreed at 483 (and at 487 in an earlier run) of 487
# teacher-forced positions as measured; exact ties in one side's logits count as agreement.
# Below 99% something changed in nanoqwen's bf16 numerics, even if every top-5 still holds.
MIN_BF16_ARGMAX_AGREEMENT = 0.99


def _long_module() -> str:
    """A deterministic 32-function Python module: about 1,400 tokens in its chat prompt."""
    parts = ['"""Small numeric helpers used by the report generator."""\n\nimport math\n']
    for i in range(1, 29):
        lo, hi = i, 3 * i + 7
        if i == 17:  # the planted bug the prompt asks about
            body = "    return max(high, min(low, value))"
        else:
            body = "    return max(low, min(high, value))"
        parts.append(
            f"\ndef clamp_{i}(value, low={lo}, high={hi}):\n"
            f'    """Clamp value into [{lo}, {hi}]."""\n{body}\n'
        )
        if i % 7 == 0:
            parts.append(
                f"\ndef scaled_norm_{i}(xs):\n"
                f'    """Euclidean norm of xs divided by {i}."""\n'
                f"    return math.sqrt(sum(x * x for x in xs)) / {i}\n"
            )
    return "".join(parts)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


PROMPTS: dict[str, list[dict[str, str]]] = {
    "code-write": _user(
        "Write a Python function `is_palindrome(s)` that ignores case and every "
        "non-alphanumeric character. Include a docstring."
    ),
    "code-explain": _user(
        "What does this function do, and what is its time complexity?\n\n```python\n"
        "def f(xs):\n    seen = set()\n    out = []\n    for x in xs:\n"
        "        if x not in seen:\n            seen.add(x)\n            out.append(x)\n"
        "    return out\n```"
    ),
    "code-fix-js": _user(
        "Fix the bug in this JavaScript:\n\n```js\nfunction sum(arr) {\n  let t = 0;\n"
        "  for (let i = 0; i <= arr.length; i++) t += arr[i];\n  return t;\n}\n```"
    ),
    "sql": _user(
        "Write a SQL query returning the five customers with the highest total order amount, "
        "from tables customers(id, name) and orders(id, customer_id, amount)."
    ),
    "prose": _user("Write a short paragraph on why the printing press changed Europe."),
    "chinese": _user("请用中文简要解释什么是递归，并举一个计算阶乘的例子。"),
    "short-answer": _user("What is 17 * 23? Reply with only the number."),
    "multi-turn": [
        {
            "role": "system",
            "content": "You are a terse senior Python reviewer. Answer in at most three sentences.",
        },
        {"role": "user", "content": "Is `except Exception: pass` ever acceptable?"},
        {
            "role": "assistant",
            "content": "Rarely: it hides every error, bugs included. Catch the specific "
            "exception you expect and handle or log it.",
        },
        {"role": "user", "content": "What about a cleanup path where failures don't matter?"},
    ],
    "long-code": _user(
        f"Here is a module:\n\n```python\n{_long_module()}```\n\n"
        "One of these functions does not do what its docstring says. Which one, and how "
        "would you fix it?"
    ),
}


@dataclass
class Reference:
    """HF-fp32 greedy output for one prompt."""

    prompt_ids: list[int]  # HF's apply_chat_template
    tokens: list[int]  # generated, up to and including the first EOS
    top_ids: torch.Tensor  # [len(tokens), 10] HF's top-10 token ids at each step
    top_logits: torch.Tensor  # [len(tokens), 10] their logits


def _timed(label: str, start: float) -> None:
    REAL_MODEL_REPORT.append(f"  {label}: {time.perf_counter() - start:.1f} s")


@pytest.fixture(scope="module")
def hf_tokenizer(real_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


@pytest.fixture(scope="module")
def hf_fp32_reference(real_model_dir, hf_tokenizer) -> dict[str, Reference]:
    """Runs HF float32 greedy on every prompt alone, once per module; frees the model."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    eos = set(hf.generation_config.eos_token_id)
    refs = {}
    for name, messages in PROMPTS.items():
        enc = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt_ids = list(enc["input_ids"])
        ids = torch.tensor([prompt_ids])
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, len(prompt_ids) :].tolist()
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        tokens = tokens[:end]  # nothing after the first EOS (padding, if any)
        top = torch.cat(out.logits[:end]).float().topk(10)
        refs[name] = Reference(prompt_ids, tokens, top.indices, top.values)
        del out
    del hf
    gc.collect()
    _timed(f"HF float32 generate, {len(PROMPTS)} prompts one by one (incl. load)", start)
    return refs


@pytest.fixture(scope="module")
def nanoqwen_fp32_outputs(real_model_dir):
    """nanoqwen float32 greedy on all prompts in one generate call; frees the engine."""
    start = time.perf_counter()
    llm = LLM(str(real_model_dir), device="cpu", dtype="float32", progress=False)
    prompt_ids = [llm.tokenizer.encode_chat(m) for m in PROMPTS.values()]
    outputs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    eos = set(llm.eos_token_ids)
    del llm
    gc.collect()
    _timed(f"nanoqwen float32 generate, {len(PROMPTS)} prompts in one batch (incl. load)", start)
    return dict(zip(PROMPTS, outputs)), eos


def test_float32_greedy_is_token_exact_with_hf(
    hf_fp32_reference, nanoqwen_fp32_outputs, real_model_dir
):
    from transformers import GenerationConfig

    outputs, eos = nanoqwen_fp32_outputs
    assert eos == set(GenerationConfig.from_pretrained(real_model_dir).eos_token_id)
    lengths = {name: len(ref.prompt_ids) for name, ref in hf_fp32_reference.items()}
    REAL_MODEL_REPORT.append(f"  prompt lengths (tokens): {lengths}")
    failures, lines = [], []
    for name, ref in hf_fp32_reference.items():
        out = outputs[name]
        if out.prompt_token_ids != ref.prompt_ids:
            failures.append(f"{name}: nanoqwen's chat template tokenizes unlike HF's")
            continue
        stopped = ref.tokens[-1] in eos
        lines.append(
            f"  {name}: prompt {len(ref.prompt_ids)}, generated {len(out.token_ids)} "
            f"(HF {len(ref.tokens)}, {'EOS' if stopped else 'length'}), "
            f"{'match' if out.token_ids == ref.tokens else 'MISMATCH'}"
        )
        if out.token_ids != ref.tokens:
            step = next(
                (i for i, (a, b) in enumerate(zip(out.token_ids, ref.tokens)) if a != b),
                min(len(out.token_ids), len(ref.tokens)),
            )
            detail = ""
            if step < min(len(out.token_ids), len(ref.tokens)):
                ours, theirs = out.token_ids[step], ref.tokens[step]
                top_ids, top_logits = ref.top_ids[step].tolist(), ref.top_logits[step].tolist()
                ours_logit = (
                    f"{top_logits[top_ids.index(ours)]:.5f}"
                    if ours in top_ids
                    else "not in HF's top 10"
                )
                detail = (
                    f": HF token {theirs} (logit {top_logits[0]:.5f}), nanoqwen token {ours} "
                    f"(HF logit {ours_logit}), HF top-2 margin {top_logits[0] - top_logits[1]:.5f}"
                )
            failures.append(f"{name}: first difference at step {step}{detail}")
            continue
        assert out.finish_reason == ("stop" if stopped else "length"), name
        if not stopped:
            assert len(out.token_ids) == NEW_TOKENS, name
    REAL_MODEL_REPORT.append("  float32 greedy vs HF:")
    REAL_MODEL_REPORT.extend(lines)
    assert not failures, "\n".join(failures)


def _in_top_k(logits: torch.Tensor, tokens: torch.Tensor, k: int = TOP_K) -> torch.Tensor:
    """Whether each row's token is in that row's top k by value (a tie with the kth counts)."""
    kth = logits.topk(k).values[:, -1]
    return logits.gather(1, tokens.unsqueeze(1)).squeeze(1) >= kth


def _rank(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """0-based rank of each row's token: how many logits are strictly larger."""
    return (logits > logits.gather(1, tokens.unsqueeze(1))).sum(1)


@pytest.fixture(scope="module")
def bf16_logits(real_model_dir, hf_fp32_reference):
    """{prompt: (nanoqwen-bf16, HF-bf16)} logits at every generated position, teacher-forced
    on HF-fp32's tokens. One model at a time, each freed when done."""
    from transformers import AutoModelForCausalLM

    inputs = {
        n: (r.prompt_ids + r.tokens[:-1], len(r.tokens)) for n, r in hf_fp32_reference.items()
    }
    start = time.perf_counter()
    llm = LLM(str(real_model_dir), device="cpu", dtype="bfloat16", progress=False)
    ours = {n: llm.runner.prompt_logits(ids, last) for n, (ids, last) in inputs.items()}
    del llm
    gc.collect()
    _timed("nanoqwen bfloat16 teacher-forced prefill (incl. load)", start)

    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.bfloat16).eval()
    theirs = {}
    with torch.inference_mode():
        for n, (ids, last) in inputs.items():
            logits = hf(torch.tensor([ids]), logits_to_keep=last).logits[0]
            theirs[n] = logits.float()
    del hf
    gc.collect()
    _timed("HF bfloat16 teacher-forced forward (incl. load)", start)
    return {n: (ours[n], theirs[n]) for n in inputs}


def test_bfloat16_top5_agreement_with_hf(bf16_logits, hf_fp32_reference):
    failures, lines = [], []
    agree = ties = total = 0
    worst = None  # the disagreement with the largest rank either way
    for name, (ours, theirs) in bf16_logits.items():
        assert ours.shape == theirs.shape == (len(hf_fp32_reference[name].tokens), ours.shape[1])
        our_top, hf_top = ours.argmax(-1), theirs.argmax(-1)
        hf_in_ours, ours_in_hf = _in_top_k(ours, hf_top), _in_top_k(theirs, our_top)
        same = our_top == hf_top
        agree, total = agree + int(same.sum()), total + len(same)
        for step in (~same).nonzero().flatten().tolist():
            r_ours = int(_rank(ours[step : step + 1], hf_top[step : step + 1]))
            r_hf = int(_rank(theirs[step : step + 1], our_top[step : step + 1]))
            gap = float(theirs[step, hf_top[step]] - theirs[step, our_top[step]])
            # Rank 0 on either side: the two tokens tie for the top logit there, and the
            # argmax among exact bf16 ties is arbitrary.
            ties += r_ours == 0 or r_hf == 0
            case = (max(r_ours, r_hf), name, step, r_ours, r_hf, gap)
            worst = max(worst or case, case)
            if not (hf_in_ours[step] and ours_in_hf[step]):
                failures.append(
                    f"{name} step {step}: HF-bf16 argmax {int(hf_top[step])} has rank {r_ours} "
                    f"in nanoqwen-bf16, nanoqwen's {int(our_top[step])} rank {r_hf} in HF "
                    f"(HF logit gap {gap:.4f})"
                )
        vs_fp32 = torch.tensor(hf_fp32_reference[name].tokens)
        lines.append(
            f"  {name}: bf16 argmax agreement {int(same.sum())}/{len(same)}, nanoqwen-bf16 vs "
            f"HF-fp32 tokens {int((our_top == vs_fp32).sum())}/{len(same)}, HF-bf16 vs HF-fp32 "
            f"{int((hf_top == vs_fp32).sum())}/{len(same)}, max |logit diff| "
            f"{float((ours - theirs).abs().max()):.3f}"
        )
    REAL_MODEL_REPORT.append(
        f"  bfloat16 teacher-forced: argmaxes agree at {agree}/{total} positions "
        f"({agree / total:.1%}), {agree + ties}/{total} counting exact ties"
    )
    REAL_MODEL_REPORT.extend(lines)
    if worst is not None:
        _, name, step, r_ours, r_hf, gap = worst
        REAL_MODEL_REPORT.append(
            f"  worst bf16 disagreement: {name} step {step}: HF's argmax rank {r_ours} in "
            f"nanoqwen, nanoqwen's argmax rank {r_hf} in HF, HF logit gap {gap:.4f}"
        )
    assert not failures, "\n".join(failures)
    assert (agree + ties) / total >= MIN_BF16_ARGMAX_AGREEMENT, (
        f"bf16 argmaxes agree at {agree}/{total} positions, {agree + ties} counting exact ties "
        f"({(agree + ties) / total:.1%}): below {MIN_BF16_ARGMAX_AGREEMENT:.0%}"
    )
