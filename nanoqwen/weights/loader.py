"""Load safetensors checkpoints straight into nanoqwen's parameters, fusing as we go."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from nanoqwen.errors import InvalidInputError
from nanoqwen.model.qwen2 import Qwen2ForCausalLM
from nanoqwen.validation import read_json_object


class LoadError(InvalidInputError):
    """A checkpoint's files are unreadable, or its tensors do not fit the model its
    config.json describes."""


# Stored dtypes a checkpoint's weights may have (safetensors' names).
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@contextlib.contextmanager
def _open(path: Path):
    """safe_open, with a truncated, empty or garbled file reported as one LoadError line."""
    try:
        f = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise LoadError(
            f"{path} is not a readable safetensors file ({detail}): allowed a complete "
            "safetensors file, as save_pretrained writes it"
        ) from None
    with f:
        yield f


# HF name suffix -> (nanoqwen parameter suffix, which shard of a fused parameter).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = read_json_object(index).get("weight_map")
        except InvalidInputError as e:
            raise LoadError(str(e)) from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise LoadError(f'{index} has no "weight_map" object naming the shards')
        if not all(isinstance(v, str) and v for v in weight_map.values()):
            raise LoadError(f'{index}: the "weight_map" values must be shard file names')
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
    elif (model_dir / "model.safetensors").exists():
        files = [model_dir / "model.safetensors"]
    else:
        raise LoadError(
            f"{model_dir} has neither model.safetensors nor model.safetensors.index.json"
        )
    for f in files:
        if not f.exists():
            raise LoadError(f"checkpoint shard {f} is missing")
    return files


def checkpoint_dtype(model_dir: Path) -> torch.dtype:
    """The dtype the checkpoint is stored in (of its first floating tensor)."""
    path = checkpoint_files(model_dir)[0]
    with _open(path) as f:
        for name in f.keys():
            dtype = f.get_slice(name).get_dtype()
            return {"BF16": torch.bfloat16, "F16": torch.float16}.get(dtype, torch.float32)
    return torch.float32


def expected_tensor_names(cfg) -> set[str]:
    per_layer = [f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    per_layer += [f"self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")]
    per_layer += [f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    per_layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    names |= {f"model.layers.{i}.{n}" for i in range(cfg.num_hidden_layers) for n in per_layer}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    return names


class _Targets:
    """Maps each checkpoint tensor to the (slice of the) parameter it fills."""

    def __init__(self, model: Qwen2ForCausalLM) -> None:
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.tied = model.config.tie_word_embeddings
        cfg = model.config
        self.shard_sizes = {
            "self_attn.qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
            "mlp.gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
        }

    def destination(self, hf_name: str) -> torch.Tensor | None:
        """The tensor view that hf_name fills, or None for tensors we skip."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if hf_name == "lm_head.weight":
            if self.tied:
                return None
            return self.params["lm_head"]
        if hf_name == "model.embed_tokens.weight":
            return self.params["embed_tokens"]
        if not hf_name.startswith("model."):
            raise LoadError(f"unexpected tensor {hf_name} in checkpoint")
        name = hf_name[len("model.") :]
        for hf_part, (ours, shard) in _FUSED.items():
            if f".{hf_part}." in name:
                fused = name.replace(hf_part, ours)
                param = self._param(fused, hf_name)
                sizes = self.shard_sizes[ours]
                start = sum(sizes[:shard])
                return param.narrow(0, start, sizes[shard])
        return self._param(name, hf_name)

    def _param(self, name: str, hf_name: str) -> torch.Tensor:
        if name not in self.params:
            raise LoadError(f"unexpected tensor {hf_name} in checkpoint")
        return self.params[name]


def load_weights(model: Qwen2ForCausalLM, model_dir: Path, progress: bool = True) -> None:
    targets = _Targets(model)
    missing = expected_tensor_names(model.config)
    files = checkpoint_files(model_dir)
    total = 0
    for path in files:
        with _open(path) as f:
            total += len(f.keys())
    with (
        torch.no_grad(),
        tqdm(
            total=total, desc="Loading weights", unit="tensor", disable=not progress, leave=False
        ) as bar,
    ):
        for path in files:
            with _open(path) as f:
                for hf_name in f.keys():
                    bar.update()
                    target = targets.destination(hf_name)
                    if target is None:
                        continue
                    stored = f.get_slice(hf_name)
                    if stored.get_dtype() not in _FLOAT_DTYPES:
                        raise LoadError(
                            f"tensor {hf_name} in {path.name} has dtype {stored.get_dtype()}: "
                            f"allowed {', '.join(_FLOAT_DTYPES)}"
                        )
                    shape = tuple(stored.get_shape())
                    if shape != tuple(target.shape):
                        raise LoadError(
                            f"tensor {hf_name} has shape {shape}, expected {tuple(target.shape)}"
                        )
                    target.copy_(f.get_tensor(hf_name))
                    missing.discard(hf_name)
    if missing:
        names = sorted(missing)
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        raise LoadError(f"checkpoint lacks tensor {names[0]}{more}")
