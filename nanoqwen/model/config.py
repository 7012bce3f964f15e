"""config.json parsing for Qwen2ForCausalLM checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nanoqwen.attention.rotary import YarnScaling
from nanoqwen.errors import InvalidInputError
from nanoqwen.validation import a_type, is_int, is_number, read_json_object, show


class ConfigError(InvalidInputError):
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
    eos_token_id: tuple[int, ...] = ()
    rope_scaling: YarnScaling | None = None

    @property
    def max_positions(self) -> int:
        """The longest context the model's positions reach: YaRN's scaled one, where larger."""
        if self.rope_scaling is None:
            return self.max_position_embeddings
        return max(self.max_position_embeddings, self.rope_scaling.max_positions)

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
    def from_dict(cls, raw: Any, source: str = "config.json") -> ModelConfig:
        """source names the file in error messages."""
        return _Reader(raw, source).config()

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        try:
            raw = read_json_object(path)
        except InvalidInputError as e:
            raise ConfigError(str(e)) from None
        return cls.from_dict(raw, str(path))


class _Reader:
    """Reads and checks each field; every refusal is `source: field=value problem: allowed`."""

    def __init__(self, raw: Any, source: str) -> None:
        if not isinstance(raw, dict):
            raise ConfigError(f"{source} holds {a_type(raw)}: allowed a JSON object")
        self.raw, self.source = raw, source

    def fail(self, key: str, value: Any, problem: str, allowed: str) -> ConfigError:
        return ConfigError(f"{self.source}: {key}={show(value)} {problem}: allowed {allowed}")

    def integer(self, key: str, default: Any = ..., minimum: int = 1) -> int:
        if key not in self.raw and default is ...:
            raise ConfigError(f"{self.source} lacks the field {key!r}")
        value = self.raw.get(key, default)
        if value is None and default is not ...:
            value = default
        allowed = f"an integer >= {minimum}"
        if not is_int(value):
            raise self.fail(key, value, "is not an integer", allowed)
        if value < minimum:
            raise self.fail(key, value, "is out of range", allowed)
        return int(value)

    def positive_number(self, key: str, value: Any) -> float:
        if not is_number(value):
            raise self.fail(key, value, "is not a number", "a number > 0")
        try:
            as_float = float(value)
        except OverflowError:  # an int past float's range
            as_float = float("inf")
        if not 0 < as_float < float("inf"):
            raise self.fail(key, value, "is out of range", "a number > 0")
        return as_float

    def config(self) -> ModelConfig:
        raw = self.raw
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type")
        if not isinstance(archs, list):
            raise self.fail("architectures", archs, "is not a list", '["Qwen2ForCausalLM"]')
        if "Qwen2ForCausalLM" not in archs and not (not archs and model_type == "qwen2"):
            field, value = ("architectures", archs) if archs else ("model_type", model_type)
            raise ConfigError(
                f"{self.source}: {field}={show(value)}: nanoqwen runs only Qwen2ForCausalLM"
            )
        if raw.get("use_sliding_window"):
            raise ConfigError(
                f"{self.source}: use_sliding_window=true: sliding-window attention is not supported"
            )
        rope_theta, rope_scaling = self.rope()
        vocab = self.integer("vocab_size")
        hidden = self.integer("hidden_size")
        heads = self.integer("num_attention_heads")
        if raw.get("head_dim") is not None:
            head_dim = self.integer("head_dim")
        elif hidden < heads:
            raise self.fail(
                "num_attention_heads", heads, "exceeds hidden_size", f"at most {hidden}"
            )
        else:
            head_dim = hidden // heads
        if head_dim % 2:
            raise ConfigError(
                f"{self.source}: head_dim={head_dim} is odd: allowed an even head_dim "
                "(RoPE rotates pairs of dimensions)"
            )
        kv_heads = self.integer("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ConfigError(
                f"{self.source}: num_key_value_heads={kv_heads} must divide "
                f"num_attention_heads={heads}"
            )
        max_positions = self.integer("max_position_embeddings", 32768, minimum=2)
        if rope_scaling is not None and rope_scaling.original_max_position_embeddings == 0:
            rope_scaling = replace(rope_scaling, original_max_position_embeddings=max_positions)
        tied = raw.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise self.fail("tie_word_embeddings", tied, "is not a bool", "true or false")
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=self.integer("intermediate_size"),
            num_hidden_layers=self.integer("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=self.positive_number("rms_norm_eps", raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=max_positions,
            tie_word_embeddings=tied,
            eos_token_id=self.eos_ids(vocab),
            rope_scaling=rope_scaling,
        )

    def eos_ids(self, vocab: int) -> tuple[int, ...]:
        eos = self.raw.get("eos_token_id")
        ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if not all(is_int(t) and 0 <= t < vocab for t in ids):
            raise self.fail(
                "eos_token_id", eos, "is invalid", f"a token id in 0..{vocab - 1} or a list of them"
            )
        return tuple(int(t) for t in ids)

    def rope(self) -> tuple[float, YarnScaling | None]:
        """rope_theta and YaRN's settings, from the classic top-level rope_theta/rope_scaling
        or the newer rope_parameters."""
        raw = self.raw
        params, scaling, theta = (
            raw.get("rope_parameters"),
            raw.get("rope_scaling"),
            raw.get("rope_theta"),
        )
        for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
            if value is not None and not isinstance(value, dict):
                raise self.fail(key, value, "is not an object", "null or an object")
        if params:
            theta = params.get("rope_theta", theta)
            scaling = scaling or params
        yarn = None
        if scaling:
            key = "rope_type" if scaling.get("rope_type") else "type"
            kind = scaling.get(key) or "default"
            field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
            if kind == "yarn":
                yarn = self.yarn(scaling, field)
            elif kind != "default":
                raise ConfigError(
                    f"{self.source}: {field}.{key}={show(kind)}: allowed default or yarn RoPE"
                )
        return self.positive_number("rope_theta", 10000.0 if theta is None else theta), yarn

    def yarn(self, scaling: dict, field: str) -> YarnScaling:
        """YaRN's fields as transformers reads them; original_max_position_embeddings 0 stands
        for max_position_embeddings (its default), filled in by config()."""

        def number(name: str, default, minimum: float, allowed: str):
            value = scaling.get(name, default)
            if value is None:
                return default
            if not is_number(value) or not minimum <= float(value) < float("inf"):
                raise self.fail(f"{field}.{name}", value, "is out of range", allowed)
            return float(value)

        if scaling.get("factor") is None:
            raise ConfigError(f"{self.source}: {field} of type yarn lacks its factor")
        original = scaling.get("original_max_position_embeddings", 0)
        if not is_int(original) or original < 0:
            raise self.fail(f"{field}.original_max_position_embeddings", original,
                            "is not a context length", "an integer >= 1")  # fmt: skip
        truncate = scaling.get("truncate", True)
        if not isinstance(truncate, bool):
            raise self.fail(f"{field}.truncate", truncate, "is not a bool", "true or false")
        return YarnScaling(
            factor=number("factor", None, 1.0, "a number >= 1"),
            original_max_position_embeddings=int(original),
            beta_fast=number("beta_fast", 32.0, 0.0, "a number >= 0"),
            beta_slow=number("beta_slow", 1.0, 0.0, "a number >= 0"),
            attention_factor=number("attention_factor", None, 0.0, "a number >= 0"),
            mscale=number("mscale", None, 0.0, "a number >= 0"),
            mscale_all_dim=number("mscale_all_dim", None, 0.0, "a number >= 0"),
            truncate=truncate,
        )
