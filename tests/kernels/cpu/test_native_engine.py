"""A bfloat16 engine on the CPU runs its decode steps on the C kernels (auto), and what it
generates is as faithful to float32 as the torch ops' bfloat16 engine: per generated token,
the engine's logprob against float32's teacher-forced one on the same context. Without a C
compiler it keeps the torch ops, after one note."""

from __future__ import annotations

import pytest
import torch
from conftest import run_without_a_compiler, write_tiny_model

from nanoqwen import LLM, SamplingParams
from nanoqwen.kernels.cpu.cpu_ops import cpu_kernels
from nanoqwen.model.layers import MLP, RMSNorm
from nanoqwen.runtime import builder

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C compiler here")
# Contexts past several 16-token blocks; head_dim 64 takes the kernel's unrolled path.
ENGINE = dict(device="cpu", block_size=16, num_kv_blocks=64, swap_space=0, progress=False)
PROMPTS = [[(5 * i + 11 * j) % 500 for j in range(3 + 37 * i)] for i in range(4)]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-native")
    write_tiny_model(
        path, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=512, num_hidden_layers=3,
    )  # fmt: skip
    return path


def error_against_float32(llm: LLM, reference: LLM) -> float:
    """Mean |logprob| gap of every generated token to float32's on the same context."""
    gaps = []
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, PARAMS)):
        tokens = prompt + out.token_ids
        logits = reference.runner.prompt_logits(tokens[:-1], last=len(out.token_ids))
        want = torch.log_softmax(logits.float(), -1)
        for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            gaps.append(abs(lp.logprob - want[i, token].item()))
    return sum(gaps) / len(gaps)


def test_bfloat16_decode_on_the_c_kernels_is_as_close_to_float32_as_torchs(model_dir, monkeypatch):
    reference = LLM(str(model_dir), dtype="float32", **ENGINE)
    assert reference.runner.model.layers[0].self_attn.backend.name == "torch"
    native = LLM(str(model_dir), dtype="bfloat16", **ENGINE)
    model = native.runner.model
    assert model.layers[0].self_attn.backend.name == "native"
    assert all(m.ops.name == "cpu" for m in model.modules() if isinstance(m, (RMSNorm, MLP)))
    monkeypatch.setattr(builder, "native_problem", lambda device, dtype: "switched off")
    torch_ops = LLM(str(model_dir), dtype="bfloat16", attention_backend="torch", **ENGINE)
    norms = [m for m in torch_ops.runner.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.ops.name == "torch" for m in norms)
    err_native = error_against_float32(native, reference)
    err_torch = error_against_float32(torch_ops, reference)
    assert err_native <= 1.5 * err_torch + 1e-3, (err_native, err_torch)


def test_without_a_compiler_a_bfloat16_engine_keeps_torchs_ops(model_dir, tmp_path):
    """A failed build is one note on stderr for each library; the engine then runs the torch
    backend and the torch sampler."""
    script = (
        "from nanoqwen import LLM, SamplingParams\n"
        f"llm = LLM({str(model_dir)!r}, dtype='bfloat16', device='cpu', num_kv_blocks=8,\n"
        "          swap_space=0, progress=False)\n"
        "params = SamplingParams(temperature=0.7, top_k=20, seed=1, max_tokens=4)\n"
        "out = llm.generate([[1, 2, 3]], params)\n"
        "print(llm.runner.model.layers[0].self_attn.backend.name,\n"
        "      type(llm.runner.sampler.passes).__name__, len(out[0].token_ids))\n"
    )
    done = run_without_a_compiler(script, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["torch", "TorchPasses", "4"]
    assert done.stderr.count("CPU kernels unavailable, using torch's ops") == 1
    assert done.stderr.count("the C sampler is unavailable, using torch's ops") == 1


def test_two_ranks_on_the_c_kernels_are_as_close_to_float32_as_one(model_dir):
    """tensor_parallel_size=2 over gloo in bfloat16: each rank's norms sum their input over
    the ranks (ReducingRMSNorm) before the C add + norm."""
    reference = LLM(str(model_dir), dtype="float32", **ENGINE)
    one = LLM(str(model_dir), dtype="bfloat16", **ENGINE)
    two = LLM(str(model_dir), dtype="bfloat16", tensor_parallel_size=2, **ENGINE)
    try:
        assert two.runner.model.layers[0].self_attn.backend.name == "native"
        assert two.runner.model.layers[0].input_layernorm.ops.name == "cpu"
        err_one = error_against_float32(one, reference)
        err_two = error_against_float32(two, reference)
    finally:
        two.close()
    assert err_two <= 1.5 * err_one + 1e-3, (err_one, err_two)
