"""No --model on the CPU: the default model runs from its GGUF file, quantized, unless the
float checkpoint is asked for (quantization="none", or float32, the token-exact mode)."""

from __future__ import annotations

import pytest
import torch

from nanoqwen import LLM, SamplingParams
from nanoqwen.kernels.cpu.gguf import gguf_kernel
from nanoqwen.quant.linear import QuantizedLinear
from nanoqwen.runtime import device_choice
from nanoqwen.runtime.device_choice import cpu_has_bf16, default_is_quantized
from nanoqwen.weights.hub import ModelNotFoundError
from nanoqwen.weights.tokenizer import Tokenizer

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("device", "dtype", "quantization", "tp", "quantized"),
    [
        (CPU, "bfloat16", "auto", 1, True),
        (CPU, "float16", "auto", 1, True),
        (CPU, "float32", "auto", 1, False),  # the token-exact tests' mode
        (CPU, "bfloat16", "none", 1, False),
        (CPU, "bfloat16", "int8", 1, False),  # the float checkpoint quantized on load
        (CPU, "bfloat16", "auto", 2, False),  # tensor parallelism takes no quantized weights
        (CUDA, "bfloat16", "auto", 1, False),  # the GPU default is unchanged
    ],
)
def test_which_default(device, dtype, quantization, tp, quantized):
    assert default_is_quantized(device, dtype, quantization, tp) is quantized


def test_dtype_auto_follows_the_cpus_bf16_support_or_the_gguf_kernels():
    """bf16 activations (so the GGUF) where the CPU does bf16 arithmetic, or where the GGUF
    kernels are built (AVX2 and up), which then run every matmul of the default model."""
    expected = cpu_has_bf16() or gguf_kernel() is not None
    assert default_is_quantized(CPU, "auto", "auto", 1) is expected


@pytest.mark.parametrize(
    ("bf16_cpu", "gguf_kernels", "stored", "expected"),
    [
        (True, False, torch.bfloat16, torch.bfloat16),
        (False, True, torch.bfloat16, torch.bfloat16),  # an AVX2 CPU running a GGUF
        (False, False, torch.bfloat16, torch.float32),  # a float checkpoint's torch matmuls
        (True, True, torch.float32, torch.float32),  # float32 checkpoints stay float32
    ],
)
def test_cpu_dtype_auto(monkeypatch, bf16_cpu, gguf_kernels, stored, expected):
    monkeypatch.setattr(device_choice, "cpu_has_bf16", lambda: bf16_cpu)
    assert device_choice.resolve_dtype("auto", CPU, stored, gguf_kernels) == expected
    assert device_choice.resolve_dtype("float32", CPU, stored, gguf_kernels) == torch.float32


def test_missing_default_gguf_is_one_clear_error(tmp_path, monkeypatch):
    from nanoqwen.weights import hub

    monkeypatch.setattr(hub, "default_model_dir", lambda: tmp_path / "Qwen")
    with pytest.raises(ModelNotFoundError) as info:
        LLM(device="cpu", dtype="bfloat16", progress=False)
    message = str(info.value)
    assert "\n" not in message
    gguf = tmp_path / ".cache" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    assert message.startswith(
        f"no --model given and the default model's GGUF file is not at {gguf}"
    )
    assert "python tools/make_qwen_coder.py" in message and "--quantization none" in message


@pytest.mark.real_model
def test_default_runs_the_gguf_quantized(real_model_dir, gguf_path):
    llm = LLM(device="cpu", dtype="bfloat16", num_kv_blocks=4, swap_space=0, progress=False)
    kinds = {m.kind for m in llm.runner.model.modules() if isinstance(m, QuantizedLinear)}
    assert isinstance(llm.runner.model.lm_head, QuantizedLinear)
    if gguf_kernel() is not None:  # the file's tensors as they are, in the C kernels
        assert kinds == {"q5_0", "q8_0", "q6_k", "q4_k"}
    else:  # torch's kernels: Q4_K kept int4, the rest per-channel int8
        assert kinds == {"int4pack", "int8pack"}
    text = "def reverse(s):"
    assert llm.tokenizer.encode(text) == Tokenizer(real_model_dir).encode(text)
    out = llm.generate([text], SamplingParams(temperature=0, max_tokens=8))[0]
    assert len(out.token_ids) == 8 and out.text.strip()


@pytest.mark.real_model
def test_a_prompt_over_the_step_token_budget_is_answered(real_model_dir, gguf_path):
    """Prefilled in chunks: the steps before the last end no prompt, so they need no logits."""
    llm = LLM(device="cpu", dtype="bfloat16", max_num_batched_tokens=256, num_kv_blocks=8,
              swap_space=0, progress=False)  # fmt: skip
    prompt = list(range(1000, 1700))  # 700 tokens: chunks of 256, 256 and 188
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
