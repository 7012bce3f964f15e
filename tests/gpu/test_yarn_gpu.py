"""YaRN RoPE on the GPU's attention paths (tiny random config, head_dim 64, an original
context of 64 scaled 4x): the Triton kernels and flash-attn's prefill read the scaled tables
as the torch backend does, in prefill (teacher-forced logits up to position 240) and in
decode (greedy tokens past the original context, with and without CUDA graphs)."""

from __future__ import annotations

import json

import pytest
import torch

from nanoqwen import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
IDS = [(7 * i) % 500 + 1 for i in range(240)]


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory):
    from conftest import write_tiny_model

    path = tmp_path_factory.mktemp("yarn-gpu")
    write_tiny_model(path, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, intermediate_size=512, max_position_embeddings=64)  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "rope_scaling": YARN}))
    return path


def engine(path, backend: str, dtype: str = "bfloat16", **options) -> LLM:
    block = 256 if backend == "flash-attn" else 16  # flash-attn's paged kernels: 256n
    return LLM(str(path), device="cuda", dtype=dtype, attention_backend=backend,
               block_size=block, num_kv_blocks=512 // block, progress=False,
               **options)  # fmt: skip


@pytest.mark.parametrize("backend", ["triton", "flash-attn"])
def test_prefill_logits_follow_the_torch_backend_past_the_original_context(yarn_model, backend):
    if backend == "flash-attn":
        pytest.importorskip("flash_attn")
    reference = engine(yarn_model, "torch", "float32").runner.prompt_logits(IDS)
    got = engine(yarn_model, backend).runner.prompt_logits(IDS)
    bf16 = engine(yarn_model, "torch").runner.prompt_logits(IDS)
    assert (got - reference).abs().mean() < 1.5 * (bf16 - reference).abs().mean()
    # Top tokens agree with float32's about as often as bfloat16 arithmetic lets them.
    agree = (got.argmax(-1) == reference.argmax(-1)).float().mean()
    assert agree >= (bf16.argmax(-1) == reference.argmax(-1)).float().mean() - 0.05


def test_graph_decode_past_the_original_context_equals_eager(yarn_model):
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    graphed = engine(yarn_model, "triton").generate([IDS[:60]], params)[0].token_ids
    eager = engine(yarn_model, "triton", enforce_eager=True).generate([IDS[:60]], params)
    assert graphed == eager[0].token_ids
