"""config.json parsing: both RoPE spellings, head_dim, and one-line refusals that name the
offending field."""

from __future__ import annotations

import json

import pytest
from transformers import Qwen2Config

from nanoqwen.model.config import ConfigError, ModelConfig

# Qwen2.5-0.5B-Instruct's published config.json: the classic top-level rope_theta form.
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def config(**changes) -> dict:
    raw = json.loads(json.dumps(QWEN25_05B))
    for key, value in changes.items():
        if value is ...:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


def refusal(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(raw)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_classic_config_matches_hf():
    cfg = ModelConfig.from_dict(config())
    hf = Qwen2Config(**config())
    assert cfg.vocab_size == hf.vocab_size == 151936
    assert cfg.hidden_size == 896 and cfg.intermediate_size == 4864
    assert cfg.num_hidden_layers == 24
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (14, 2)
    assert cfg.head_dim == 64 == hf.hidden_size // hf.num_attention_heads
    assert cfg.rope_theta == 1e6 == hf.rope_parameters["rope_theta"]
    assert cfg.rms_norm_eps == 1e-6
    assert cfg.max_position_embeddings == 32768
    assert cfg.tie_word_embeddings is True
    assert cfg.eos_token_id == (151645,)
    assert (cfg.q_size, cfg.kv_size) == (896, 128)


def test_rope_parameters_form():
    raw = config(rope_theta=..., rope_scaling=...)
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    assert ModelConfig.from_dict(raw).rope_theta == 500000.0
    # rope_parameters wins over a stale top-level value, as transformers 5 reads it.
    raw["rope_theta"] = 10000.0
    assert ModelConfig.from_dict(raw).rope_theta == 500000.0


def test_transformers5_written_config(tiny_model):
    """The tiny checkpoint's config.json is written by transformers 5 (rope_parameters,
    dtype instead of torch_dtype)."""
    raw = json.loads((tiny_model[0] / "config.json").read_text())
    assert "rope_parameters" in raw
    cfg = ModelConfig.from_file(tiny_model[0] / "config.json")
    hf = tiny_model[1].config
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] == 10000.0
    assert cfg.head_dim == hf.head_dim == 16
    assert cfg.vocab_size == 512 and cfg.tie_word_embeddings
    assert cfg.eos_token_id == (hf.eos_token_id,)


def test_rope_theta_defaults_to_10000():
    assert ModelConfig.from_dict(config(rope_theta=...)).rope_theta == 10000.0


@pytest.mark.parametrize(
    ("changes", "head_dim"),
    [
        (dict(), 64),  # absent: hidden_size // num_attention_heads
        (dict(head_dim=None), 64),
        (dict(head_dim=128), 128),  # present and different (as in Qwen3-style configs)
    ],
)
def test_head_dim(changes, head_dim):
    cfg = ModelConfig.from_dict(config(**changes))
    assert cfg.head_dim == head_dim
    assert cfg.q_size == 14 * head_dim and cfg.kv_size == 2 * head_dim


def test_eos_token_id_list_and_absent():
    assert ModelConfig.from_dict(config(eos_token_id=[1, 2])).eos_token_id == (1, 2)
    assert ModelConfig.from_dict(config(eos_token_id=...)).eos_token_id == ()


def test_num_key_value_heads_defaults_to_heads():
    assert ModelConfig.from_dict(config(num_key_value_heads=...)).num_key_value_heads == 14


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            dict(architectures=["LlamaForCausalLM"]),
            "architectures=['LlamaForCausalLM']: nanoqwen runs only Qwen2ForCausalLM",
        ),
        (
            dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe"),
            "architectures=['Qwen2MoeForCausalLM']: nanoqwen runs only Qwen2ForCausalLM",
        ),
        (
            dict(architectures=..., model_type="llama"),
            "model_type='llama': nanoqwen runs only Qwen2ForCausalLM",
        ),
        (
            dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
            "rope_scaling.rope_type='dynamic': allowed default or yarn RoPE",
        ),
        (
            dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}),
            "rope_parameters.rope_type='linear': allowed default or yarn RoPE",
        ),
        (
            dict(use_sliding_window=True),
            "use_sliding_window=true: sliding-window attention is not supported",
        ),
        (
            dict(num_key_value_heads=4),
            "num_key_value_heads=4 must divide num_attention_heads=14",
        ),
        (dict(hidden_size=...), "config.json lacks the field 'hidden_size'"),
        # Types and ranges: each was a traceback or a silently wrong model before.
        (
            dict(num_attention_heads=0),
            "num_attention_heads=0 is out of range: allowed an integer >= 1",
        ),
        (dict(vocab_size=-1), "vocab_size=-1 is out of range: allowed an integer >= 1"),
        (dict(vocab_size=1.5), "vocab_size=1.5 is not an integer: allowed an integer >= 1"),
        (dict(hidden_size="896"), "hidden_size='896' is not an integer: allowed an integer >= 1"),
        (dict(num_hidden_layers=True), "num_hidden_layers=True is not an integer"),
        (
            dict(num_attention_heads=1000),
            "num_attention_heads=1000 exceeds hidden_size: allowed at most 896",
        ),
        (dict(head_dim=63), "head_dim=63 is odd: allowed an even head_dim"),
        (dict(num_key_value_heads=0), "num_key_value_heads=0 is out of range"),
        (dict(rms_norm_eps=0), "rms_norm_eps=0 is out of range: allowed a number > 0"),
        (dict(rope_theta="big"), "rope_theta='big' is not a number: allowed a number > 0"),
        (dict(max_position_embeddings=1), "max_position_embeddings=1 is out of range"),
        (dict(tie_word_embeddings="yes"), "tie_word_embeddings='yes' is not a bool"),
        (dict(eos_token_id=-1), "eos_token_id=-1 is invalid: allowed a token id in 0..151935"),
        (dict(eos_token_id=[1, 200000]), "eos_token_id=[1, 200000] is invalid"),
        (dict(rope_scaling="linear"), "rope_scaling='linear' is not an object"),
        (dict(architectures="Qwen2ForCausalLM"), "architectures='Qwen2ForCausalLM' is not a list"),
    ],
)
def test_refusals_name_the_file_and_field(changes, expected):
    message = refusal(config(**changes))
    assert message.startswith("config.json: " if "lacks" not in expected else "config.json")
    assert expected in message, message


def test_a_config_that_is_not_an_object_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_file(path)
    assert str(info.value) == f"{path} holds a list: allowed a JSON object"


def test_a_config_that_is_not_utf8_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ConfigError, match=rf"^{path} is not UTF-8 text \(byte 0xff at offset 7\)$"):
        ModelConfig.from_file(path)


def test_model_type_alone_is_accepted():
    assert ModelConfig.from_dict(config(architectures=...)).hidden_size == 896


def test_default_rope_scaling_is_accepted():
    raw = config(rope_scaling={"rope_type": "default"})
    assert ModelConfig.from_dict(raw).rope_theta == 1e6


def test_invalid_json_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=rf"^{path} is not valid JSON \(.* at line 1 column 2\)$"):
        ModelConfig.from_file(path)


def test_num_parameters_matches_hf(tiny_model):
    cfg = ModelConfig.from_file(tiny_model[0] / "config.json")
    hf = tiny_model[1]
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
