"""YaRN RoPE (rope_scaling type yarn, as Qwen2.5 reaches 128K): greedy float32 output is HF's
token for token at positions past original_max_position_embeddings, every CPU backend agrees,
a GGUF's rope.scaling keys are read, and bad values are one-line errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import write_tiny_model

from nanoqwen import LLM, InvalidInputError, SamplingParams
from nanoqwen.model.config import ModelConfig
from nanoqwen.weights.gguf import GGUFCheckpoint

# A small original context, so positions past it are cheap: 64 tokens, scaled 4x to 256.
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("yarn-tiny")
    write_tiny_model(path, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, max_position_embeddings=64)  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "rope_scaling": YARN}))
    from transformers import Qwen2ForCausalLM

    hf = Qwen2ForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return path, hf


PROMPTS = [[(5 * i + 3) % 500 + 1 for i in range(n)] for n in (40, 70, 150)]


def test_greedy_output_is_hf_past_the_original_context(yarn_model):
    path, hf = yarn_model
    llm = LLM(str(path), dtype="float32", attention_backend="torch", block_size=16,
              num_kv_blocks=64, progress=False)  # fmt: skip
    assert llm.max_model_len == 256
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            full = hf.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False,
                               eos_token_id=None, pad_token_id=0)  # fmt: skip
        want = full[0, len(prompt) :].tolist()
        assert out.token_ids == want, len(prompt)


def test_scaled_logits_are_hf_and_the_backends_agree(yarn_model):
    """float32 torch backend against HF; in bfloat16 the native (C) backend against the torch
    one, at positions up to 240 (the original context is 64)."""
    path, hf = yarn_model
    ids = [(7 * i) % 500 + 1 for i in range(240)]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()

    def logits(backend: str, dtype: str) -> torch.Tensor:
        llm = LLM(str(path), dtype=dtype, attention_backend=backend, block_size=16,
                  num_kv_blocks=64, progress=False)  # fmt: skip
        return llm.runner.prompt_logits(ids)

    torch.testing.assert_close(logits("torch", "float32"), want, atol=2e-4, rtol=0)
    native, torch_bf16 = logits("native", "bfloat16"), logits("torch", "bfloat16")
    assert (native.argmax(-1) == torch_bf16.argmax(-1)).float().mean() > 0.95
    # Both as far from float32 as bfloat16 makes them (plain RoPE's tables: ~40x further).
    noise = (torch_bf16 - want).abs().mean()
    assert (native - want).abs().mean() < 1.5 * noise


def test_native_decode_reads_the_scaled_tables(yarn_model):
    """The C decode kernel past position 64 (the first token comes from the prefill, the
    second from a decode step): in bfloat16 its log-probabilities are the float32 torch
    backend's (HF's, above) to bfloat16's rounding, the 0.15 a token that the GPU's HF
    fidelity test allows. Plain RoPE's tables change even the first token. Against float32,
    not the torch backend's bfloat16, whose own rounding depends on the CPU's matmul path
    (0.14 from float32 on an AVX-512 machine without AMX)."""
    path, _ = yarn_model
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=5)
    outs = {}
    for backend, dtype in (("native", "bfloat16"), ("torch", "float32")):
        llm = LLM(str(path), dtype=dtype, attention_backend=backend, block_size=16,
                  num_kv_blocks=64, progress=False)  # fmt: skip
        outs[backend] = llm.generate(PROMPTS, params)
    for native, reference in zip(outs["native"], outs["torch"]):
        assert native.token_ids[0] == reference.token_ids[0]
        a, b = dict(native.logprobs[1].top), dict(reference.logprobs[1].top)
        shared = a.keys() & b.keys()
        assert len(shared) >= 3
        assert max(abs(a[t] - b[t]) for t in shared) < 0.15


def test_plain_rope_past_the_original_context_would_differ(yarn_model):
    """The check above is not vacuous: without YaRN the same weights give other logits."""
    path, hf = yarn_model
    ids = [(7 * i) % 500 + 1 for i in range(200)]
    plain = LLM(str(path), dtype="float32", attention_backend="torch", block_size=16,
                num_kv_blocks=64, progress=False)  # fmt: skip
    cfg = plain.config
    assert cfg.rope_scaling is not None and cfg.max_positions == 256
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    rotary = plain.runner.model.rotary
    from nanoqwen.attention.rotary import RotaryEmbedding

    default = RotaryEmbedding(cfg.head_dim, 256, cfg.rope_theta, "cpu")
    rotary.cos_half.copy_(default.cos_half)
    rotary.sin_half.copy_(default.sin_half)
    assert (plain.runner.prompt_logits(ids) - want).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"type": "linear", "factor": 2.0}, "config.json: rope_scaling.type='linear': allowed "
         "default or yarn RoPE"),
        ({"type": "yarn"}, "config.json: rope_scaling of type yarn lacks its factor"),
        ({"type": "yarn", "factor": 0.5}, "config.json: rope_scaling.factor=0.5 is out of range: "
         "allowed a number >= 1"),
        ({"type": "yarn", "factor": 4, "original_max_position_embeddings": "32k"},
         "config.json: rope_scaling.original_max_position_embeddings='32k' is not a context "
         "length"),
        ({"rope_type": "yarn", "factor": 4, "truncate": "yes"},
         "config.json: rope_scaling.truncate='yes' is not a bool"),
    ],
)  # fmt: skip
def test_bad_rope_scaling_is_one_line(scaling, message):
    raw = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 32, "hidden_size": 16,
           "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
           "rope_scaling": scaling}  # fmt: skip
    with pytest.raises(InvalidInputError) as info:
        ModelConfig.from_dict(raw)
    assert str(info.value).startswith(message)


def test_yarn_defaults_and_the_original_context():
    raw = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 32, "hidden_size": 16,
           "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
           "max_position_embeddings": 32768,
           "rope_scaling": {"type": "yarn", "factor": 4.0}}  # fmt: skip
    cfg = ModelConfig.from_dict(raw)
    # Without original_max_position_embeddings, transformers takes max_position_embeddings.
    assert cfg.rope_scaling.original_max_position_embeddings == 32768
    assert cfg.max_positions == 131072
    assert cfg.rope_scaling.cos_sin_factor() == pytest.approx(0.1 * math.log(4.0) + 1)


def test_gguf_rope_scaling_keys_become_yarn():
    hp = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
          "rope.scaling.original_context_length": 32768}  # fmt: skip
    assert GGUFCheckpoint._rope_scaling(hp) == {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    assert GGUFCheckpoint._rope_scaling({}) is None
    assert GGUFCheckpoint._rope_scaling({"rope.scaling.type": "linear"}) == {"type": "linear"}
