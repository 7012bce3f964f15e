"""Synthetic GGUF data for the tests: raw rows of blocks of any type gguf_blocks reads, and a
tiny Qwen2 written as a GGUF file (conftest's checkpoint, its tensors quantized)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from conftest import write_tiny_model

from nanoqwen.model.config import ModelConfig
from nanoqwen.quant.gguf_blocks import BLOCK_SIZES
from nanoqwen.weights.gguf import LAYER_NAMES, TOP_NAMES

# Where each block keeps its float16 scales (Q4_K: d and dmin), which random bytes would make
# NaN or huge; everything else in a block is codes and integer sub-scales, any byte valid.
_F16_AT = {
    "Q8_0": (0,), "Q5_0": (0,), "Q4_0": (0,), "Q6_K": (208,), "Q4_K": (0, 2), "Q5_K": (0, 2),
    "Q3_K": (108,), "Q2_K": (80, 82), "Q4_1": (0, 2), "Q5_1": (0, 2),
}  # fmt: skip
_SCALE = {
    "Q8_0": 0.01, "Q5_0": 0.01, "Q4_0": 0.01, "Q6_K": 1e-4, "Q4_K": 1e-3, "Q5_K": 1e-3,
    "Q3_K": 1e-3, "Q2_K": 1e-3, "Q4_1": 0.01, "Q5_1": 0.01,
}  # fmt: skip
# Blocks with a min as well as a scale, which kernels of their own read: random blocks in the
# tests that take K_QUANTS' (any code and scale), beside them.
WITH_MINS = ("Q4_1", "Q5_1")
K_QUANTS = (
    "Q6_K",
    "Q4_K",
    "Q5_K",
    "Q3_K",
    "Q2_K",
)  # superblocks of 256 values, which gguf.quants cannot write
GGUF_NAMES = {hf: ours for ours, hf in (*LAYER_NAMES.items(), *TOP_NAMES.items())}


def random_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Raw rows [n, bytes per row] of random codes (every byte value) and finite float16
    scales of both signs: layouts beyond what a quantizer writes."""
    values, size = BLOCK_SIZES[type_name]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    for at in _F16_AT[type_name]:
        d = (rng.standard_normal((n, k // values)) * _SCALE[type_name]).astype(np.float16)
        b[..., at : at + 2] = d.view(np.uint8).reshape(n, k // values, 2)
    return b.reshape(n, -1)


def gguf_name(hf_name: str) -> str:
    """nanoqwen.weights.gguf.hf_name's inverse."""
    found = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name)
    if found is None:
        return GGUF_NAMES[hf_name]
    layer, part, kind = found.groups()
    return f"blk.{layer}.{GGUF_NAMES[part]}.{kind}"


def write_gguf(
    directory: Path, tied: bool, types: dict[str, str], bos: bool = True, **shape: int
) -> Path:
    """A tiny Qwen2 (write_tiny_model's, with `shape`'s sizes) as GGUF, its tokenizer files
    beside it (open_gguf reads those). 2-D tensors take types[hf name] (Q5_0 if absent):
    those gguf.quants cannot quantize (the K-quants) get random blocks; 1-D ones are F32.
    bos=False: no tokenizer.ggml.bos_token_id, as llama.cpp's converter writes Qwen2.5."""
    import gguf

    model = write_tiny_model(directory, tie_word_embeddings=tied, **shape)
    cfg = ModelConfig.from_file(directory / "config.json")
    path = directory / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in {
        "block_count": cfg.num_hidden_layers,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
    }.items():
        writer.add_uint32(f"qwen2.{key}", value)
    writer.add_float32("qwen2.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32("qwen2.rope.freq_base", cfg.rope_theta)
    if bos:
        writer.add_uint32("tokenizer.ggml.bos_token_id", model.config.bos_token_id)
    writer.add_uint32("tokenizer.ggml.eos_token_id", model.config.eos_token_id)
    for i, (name, value) in enumerate(model.state_dict().items()):
        if tied and name == "lm_head.weight":
            continue
        w = value.float().numpy()
        kind = types.get(name, "Q5_0") if w.ndim == 2 else "F32"
        if kind in ("F32", "F16"):
            writer.add_tensor(gguf_name(name), w.astype(np.float16 if kind == "F16" else w.dtype))
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in K_QUANTS:
            raw = random_blocks(kind, *w.shape, seed=i)
        else:
            raw = gguf.quants.quantize(w, qtype)
        writer.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
