"""Load safetensors checkpoints straight into nanoqwen's parameters, fusing as we go."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Split:
    """Which part of a checkpoint tensor this rank loads: along dim, `length` entries from
    `start`, of `full` in all (vocabulary rows past the end are the last rank's zero padding).
    """

    dim: int
    start: int
    length: int
    full: int


class _Targets:
    """Maps each checkpoint tensor to the (slice of the) parameter it fills, and, when the
    model is one rank of a tensor-parallel group, to the part of the tensor that rank holds."""

    def __init__(self, model: Qwen2ForCausalLM) -> None:
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.tied = model.config.tie_word_embeddings
        cfg = model.config  # this rank's shapes
        self.shard_sizes = {
            "self_attn.qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
            "mlp.gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
        }
        tp = getattr(model, "tp", None)
        self.rank, self.size = (tp.rank, tp.size) if tp is not None else (0, 1)
        self.vocab = model.full_config.vocab_size if tp is not None else cfg.vocab_size

    def destination(self, hf_name: str) -> tuple[torch.Tensor, _Split | None] | None:
        """The tensor view that hf_name fills and the part of hf_name that goes there (None:
        all of it), or None for tensors we skip."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if hf_name in ("lm_head.weight", "model.embed_tokens.weight"):
            if hf_name == "lm_head.weight" and self.tied:
                return None
            param = self.params["lm_head" if hf_name == "lm_head.weight" else "embed_tokens"]
            return param, self._split(0, param.shape[0], self.vocab)
        if not hf_name.startswith("model."):
            raise LoadError(f"unexpected tensor {hf_name} in checkpoint")
        name = hf_name[len("model.") :]
        for hf_part, (ours, shard) in _FUSED.items():
            if f".{hf_part}." in name:
                fused = name.replace(hf_part, ours)
                param = self._param(fused, hf_name)
                sizes = self.shard_sizes[ours]
                start = sum(sizes[:shard])
                split = self._split(0, sizes[shard], sizes[shard] * self.size)
                return param.narrow(0, start, sizes[shard]), split
        param = self._param(name, hf_name)
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            # Row-parallel: this rank multiplies its slice of the input features.
            return param, self._split(1, param.shape[1], param.shape[1] * self.size)
        return param, None

    def _split(self, dim: int, length: int, full: int) -> _Split | None:
        if self.size == 1:
            return None
        start = self.rank * length
        return _Split(dim, start, max(0, min(length, full - start)), full)

    def _param(self, name: str, hf_name: str) -> torch.Tensor:
        if name not in self.params:
            raise LoadError(f"unexpected tensor {hf_name} in checkpoint")
        return self.params[name]


def _read(f, hf_name: str, target: torch.Tensor, split: _Split | None) -> None:
    """Copies hf_name (or only this rank's part of it: get_slice reads no more) into target."""
    stored = f.get_slice(hf_name)
    shape = tuple(stored.get_shape())
    expected = tuple(target.shape)
    if split is not None:
        expected = expected[: split.dim] + (split.full,) + expected[split.dim + 1 :]
    if shape != expected:
        raise LoadError(f"tensor {hf_name} has shape {shape}, expected {expected}")
    if split is None:
        target.copy_(f.get_tensor(hf_name))
        return
    index = [slice(None)] * len(shape)
    index[split.dim] = slice(split.start, split.start + split.length)
    part = target.narrow(split.dim, 0, split.length)
    part.copy_(stored[tuple(index)])
    if split.length < target.shape[split.dim]:  # the last vocabulary shard's padding
        target.narrow(split.dim, split.length, target.shape[split.dim] - split.length).zero_()


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
                    found = targets.destination(hf_name)
                    if found is None:
                        continue
                    dtype = f.get_slice(hf_name).get_dtype()
                    if dtype not in _FLOAT_DTYPES:
                        raise LoadError(
                            f"tensor {hf_name} in {path.name} has dtype {dtype}: "
                            f"allowed {', '.join(_FLOAT_DTYPES)}"
                        )
                    _read(f, hf_name, *found)
                    missing.discard(hf_name)
    if missing:
        names = sorted(missing)
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        raise LoadError(f"checkpoint lacks tensor {names[0]}{more}")
