"""Loads a GGUF file's tensors into a built Qwen2ForCausalLM: quantized linear layers stay
quantized (QuantizedLinear), the embedding becomes a dequantizing lookup (of the file's own
blocks, decoded a row at a time, on the CPU), the rest (norms, biases) is copied as float."""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from nanoqwen.model.config import ModelConfig
from nanoqwen.model.load_checkpoint import _FUSED, LoadError, _Targets, expected_tensor_names
from nanoqwen.model.quantize import install, set_module
from nanoqwen.model.qwen2 import Qwen2ForCausalLM
from nanoqwen.quant.format import QuantizedWeight, cat_rows, quantize_int8
from nanoqwen.quant.gguf_blocks import EXACT_TYPES, from_gguf_blocks
from nanoqwen.quant.gguf_packed import (
    PackedBlocks,
    PackedParts,
    from_file,
    keeps_file_blocks,
    stack_packed,
    to_canonical,
)
from nanoqwen.quant.gguf_rows import GGUFRows
from nanoqwen.quant.linear import QuantizedEmbedding
from nanoqwen.quant.scheme import SCHEMES, Scheme
from nanoqwen.weights.gguf import GGUFCheckpoint, GGUFTensor
from nanoqwen.weights.tokenizer import Tokenizer

EMBEDDING = "model.embed_tokens.weight"


def _canonical(t: GGUFTensor) -> QuantizedWeight | torch.Tensor:
    """The tensor as GGUF stores it: exact canonical codes, or float32 for other types."""
    if t.type_name in EXACT_TYPES:
        return from_gguf_blocks(t.type_name, t.data)
    return torch.from_numpy(t.to_float32())


def _embedding(t: GGUFTensor, device: torch.device) -> QuantizedWeight | GGUFRows:
    """The embedding's quantized rows. On the CPU, where gguf_blocks reads the type exactly:
    the file's blocks, decoded at each lookup. A GPU takes the whole decoded weight (to its
    memory) and other types (float ones) are quantized to int8, now."""
    if t.type_name in EXACT_TYPES and device.type == "cpu":
        return GGUFRows(t.type_name, t.own_mapping())
    value = _canonical(t)
    return value if isinstance(value, QuantizedWeight) else quantize_int8(value, 32)


def _decoded(w: QuantizedWeight | GGUFRows) -> QuantizedWeight:
    return w.decode() if isinstance(w, GGUFRows) else w


def _linear_weight(
    t: GGUFTensor, scheme: Scheme, direct: bool, canonical=_canonical
) -> QuantizedWeight | PackedBlocks:
    """The scheme's layout of a linear weight. `direct`: the scheme keeps Q5_0/Q8_0 blocks for
    the CPU kernels, so those go from the file's bytes into the kernels' layout, not through
    the canonical codes (canonical(t), packed again by QuantizedLinear.prepare)."""
    packed = from_file(t.type_name, t.data) if direct else None
    return packed if packed is not None else scheme.apply(canonical(t))


def _module_and_shard(hf_name: str) -> tuple[str, int]:
    """'model.layers.3.self_attn.k_proj.weight' -> ('layers.3.self_attn.qkv_proj', 1)."""
    if hf_name == "lm_head.weight":
        return "lm_head", 0
    name = hf_name.removeprefix("model.").removesuffix(".weight")
    for hf_part, (ours, shard) in _FUSED.items():
        if name.endswith(hf_part):
            return name.removesuffix(hf_part) + ours, shard
    return name, 0


def _fuse(
    parts: list[QuantizedWeight | PackedBlocks],
) -> QuantizedWeight | PackedBlocks | PackedParts:
    """The parts of a fused projection stacked: in the kernels' layouts where every part
    loaded into one (side by side where those differ); else their canonical weights, and
    per-channel int8 for all of them when those differ in layout."""
    if all(isinstance(p, PackedBlocks) for p in parts):
        return stack_packed(parts)
    parts = [to_canonical(p) if isinstance(p, PackedBlocks) else p for p in parts]
    try:
        return cat_rows(parts)
    except ValueError:
        return cat_rows([SCHEMES["int8"].apply(p) for p in parts])


def load_gguf(
    net: Qwen2ForCausalLM,
    ckpt: GGUFCheckpoint,
    scheme: Scheme | None,
    dtype: torch.dtype,
    progress: bool = True,
) -> None:
    """scheme=None dequantizes every tensor into the model's float parameters (the
    reference model); otherwise linear weights are converted to the scheme's layout (kept
    exact where the GGUF already has it) and the embedding keeps the file's own codes."""
    targets = _Targets(net)
    missing = expected_tensor_names(net.config)
    shards: dict[str, dict[int, QuantizedWeight | PackedBlocks]] = {}
    embedding: QuantizedWeight | GGUFRows | None = None
    embedding_file: GGUFTensor | None = None
    device = net.norm.weight.device
    direct = keeps_file_blocks(scheme, device, dtype)
    tensors = list(ckpt.tensors())
    with torch.no_grad():
        for t in tqdm(
            tensors, desc="Loading GGUF", unit="tensor", disable=not progress, leave=False
        ):
            found = targets.destination(t.name)
            missing.discard(t.name)
            if found is None:
                continue
            target, _ = found  # the whole tensor: GGUF models run on one rank
            if tuple(t.shape) != tuple(target.shape):
                raise LoadError(
                    f"{ckpt.path}: tensor {t.name} has shape {t.shape}, expected "
                    f"{tuple(target.shape)}"
                )
            if scheme is None or len(t.shape) != 2:
                target.copy_(torch.from_numpy(t.to_float32()))
                continue
            if t.name == EMBEDDING:
                embedding, embedding_file = _embedding(t, device), t
                continue
            module, shard = _module_and_shard(t.name)
            shards.setdefault(module, {})[shard] = _linear_weight(t, scheme, direct)
    if missing:
        names = sorted(missing)
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        raise LoadError(f"{ckpt.path} lacks tensor {names[0]}{more}")
    if scheme is None:
        return
    weights = {m: _fuse([parts[i] for i in sorted(parts)]) for m, parts in shards.items()}
    if net.config.tie_word_embeddings:
        weights["lm_head"] = _linear_weight(
            embedding_file, scheme, direct, lambda _: _decoded(embedding)
        )
    install(net, {m: w.to(device) for m, w in weights.items()}, dtype)
    set_module(net, "embed_tokens", QuantizedEmbedding(embedding.to(device), dtype))


def open_gguf(
    path: str | Path, tokenizer_dir: Path | None = None
) -> tuple[GGUFCheckpoint, ModelConfig, Tokenizer]:
    """The checkpoint, its config and its tokenizer: the one in `tokenizer_dir` if given, else
    a tokenizer.json beside the file (with its tokenizer_config.json) when there is one, else
    the one in the file's metadata."""
    ckpt = GGUFCheckpoint(path)
    cfg = ModelConfig.from_dict(ckpt.hf_config(), str(ckpt.path))
    beside = tokenizer_dir or ckpt.path.parent
    if (beside / "tokenizer.json").is_file():
        return ckpt, cfg, Tokenizer(beside)
    eos = set(ckpt.generation_config()["eos_token_id"])
    tokenizer = Tokenizer.from_parts(ckpt.tokenizer(), ckpt.tokenizer_config(), eos, str(ckpt.path))
    if tokenizer.eos_token is not None and tokenizer.token_to_id(tokenizer.eos_token) is not None:
        tokenizer.eos_token_ids |= {tokenizer.token_to_id(tokenizer.eos_token)}
    return ckpt, cfg, tokenizer
