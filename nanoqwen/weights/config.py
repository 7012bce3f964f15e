"""config.json parsing for Qwen2ForCausalLM checkpoints."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A checkpoint's config.json describes a model nanoqwen cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + (self.q_size + 2 * self.kv_size)
        attn += self.q_size * h
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + head

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type")
        if "Qwen2ForCausalLM" not in archs and not (not archs and model_type == "qwen2"):
            field, value = ("architectures", archs) if archs else ("model_type", model_type)
            raise ConfigError(f"{field}={value!r}: nanoqwen runs only Qwen2ForCausalLM")
        rope_theta = _rope_theta(raw)
        for key in ("use_sliding_window",):
            if raw.get(key):
                raise ConfigError(f"{key}=true: sliding-window attention is not supported")
        heads = _required(raw, "num_attention_heads")
        hidden = _required(raw, "hidden_size")
        head_dim = raw.get("head_dim") or hidden // heads
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ConfigError(
                f"num_key_value_heads={kv_heads} must divide num_attention_heads={heads}"
            )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=_required(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(raw, "intermediate_size"),
            num_hidden_layers=_required(raw, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw)


def _required(raw: dict[str, Any], key: str) -> int:
    if key not in raw:
        raise ConfigError(f"config.json lacks the field {key!r}")
    return int(raw[key])


def _rope_theta(raw: dict[str, Any]) -> float:
    """Accept the classic top-level rope_theta/rope_scaling and the newer rope_parameters."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        scaling = scaling or params
    if scaling:
        key = "rope_type" if scaling.get("rope_type") else "type"
        kind = scaling.get(key) or "default"
        if kind != "default":
            field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
            raise ConfigError(f"{field}.{key}={kind!r}: only default RoPE is supported")
    return float(theta if theta is not None else 10000.0)
