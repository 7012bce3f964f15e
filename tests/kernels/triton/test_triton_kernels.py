"""The Triton GEMV, add+RMSNorm and SiLU·up kernels against the layers they replace.

On CPU these run in Triton's interpreter (tests/conftest.py) in float32; tests/gpu runs the
whole model compiled in bfloat16 against HF.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
# With a GPU the kernels compile for it and cannot take these CPU tensors; tests/gpu covers
# them there (backend agreement, graph replay, fidelity with HF).
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter"
)
from nanoqwen.kernels.layer_ops import TORCH_OPS, triton_ops  # noqa: E402
from nanoqwen.kernels.triton.gemv import gemv, gemv_silu_mul  # noqa: E402

# (rows, columns): down_proj-like long rows, many short rows, and odd sizes that leave
# partial blocks in both directions.
SHAPES = [(37, 300), (5, 2000), (9000, 100), (130, 1100)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_gemv_equals_linear(n, k, bias):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    torch.testing.assert_close(gemv(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_gemv_silu_mul_equals_mlp_activation(n, k):
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=gen)
    gate_up = torch.randn(2 * n, k, generator=gen)
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    torch.testing.assert_close(gemv_silu_mul(x, gate_up), F.silu(gate) * up, rtol=1e-4, atol=1e-3)


def test_fused_model_generates_what_the_reference_layers_generate(tiny_model):
    """Batch-1 decode through every fused kernel (add+RMSNorm, GEMV with bias, GEMV with
    SiLU·up, lm_head GEMV) picks the same greedy tokens with the same logits."""
    from nanoqwen import LLM, SamplingParams

    path, _ = tiny_model
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [5, 17, 99, 3]
    tokens, logits = {}, {}
    for fused in (False, True):
        llm = LLM(str(path), dtype="float32", progress=False)
        llm.runner.model.set_ops(triton_ops() if fused else TORCH_OPS)
        tokens[fused] = llm.generate([prompt], params)[0].token_ids
        logits[fused] = llm.runner.prompt_logits(prompt + tokens[fused], last=1)
    assert tokens[True] == tokens[False]
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)
