"""A Qwen2 GGUF file read as a checkpoint: config.json, generation_config.json and
tokenizer_config.json equivalents from its metadata, and its tensors under HF names.

tools/make_qwen_coder.py writes these out as a Hugging Face directory; LLM("x.gguf") uses them
directly (nanoqwen/quant/gguf_model.py keeps the tensors quantized).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from nanoqwen.errors import InvalidInputError
from nanoqwen.weights.gguf_reader import read_gguf

# llama.cpp permutes q/k only on its llama path; qwen2 tensors are stored as HF has them, so the
# mapping is a plain rename (greedy decoding would turn to garbage otherwise).
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFError(InvalidInputError):
    """A GGUF file nanoqwen cannot read as a Qwen2 checkpoint."""


def is_gguf(model: str | Path | None) -> bool:
    return model is not None and str(model).lower().endswith(".gguf")


def hf_name(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if not match or match[2] not in LAYER_NAMES:
        raise GGUFError(f"unexpected tensor {name!r} in the GGUF; only Qwen2 layouts are known")
    return f"model.layers.{match[1]}.{LAYER_NAMES[match[2]]}.{match[3]}"


@dataclass
class GGUFTensor:
    name: str  # HF name
    type_name: str  # ggml type: F32, F16, Q8_0, Q4_K, ...
    shape: tuple[int, ...]  # rows first, as torch has it
    data: np.ndarray  # a view of the memory-mapped file: raw blocks for quantized types
    path: Path  # the file, and where data starts in it
    offset: int

    def own_mapping(self) -> np.ndarray:
        """data, read-only, in a mapping of the file that covers only this tensor: for what
        outlives the load. A view of `data` would keep the whole file's mapping, and with it
        every page the load read (all the file's tensors) resident in the process."""
        mapped = np.memmap(self.path, self.data.dtype, "r", self.offset, self.data.shape)
        return np.asarray(mapped)  # a plain view: numpy's memmap subclass slows each index

    def to_float32(self) -> np.ndarray:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.data, GGMLQuantizationType[self.type_name])
        values = np.asarray(values, dtype=np.float32).reshape(self.shape)
        return values if values.flags.writeable else values.copy()  # F32: a view of the file


class GGUFCheckpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise GGUFError(f"model path {path} does not exist")
        try:
            self.metadata, self._raw = read_gguf(self.path)
        except (ValueError, OSError, KeyError, struct.error) as e:
            raise GGUFError(f"{self.path} is not a readable GGUF file ({e})") from None
        arch = self.metadata.get("general.architecture")
        if arch != "qwen2":
            raise GGUFError(f"{self.path}: architecture {arch!r}: nanoqwen runs only 'qwen2'")

    def _field(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensors(self) -> Iterator[GGUFTensor]:
        for t in self._raw:
            # GGUF lists dims fastest-first; torch wants rows first.
            shape = tuple(reversed(t.dims))
            yield GGUFTensor(hf_name(t.name), t.type_name, shape, t.data, self.path, t.offset)

    @cached_property
    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.name: t.shape for t in self.tensors()}

    @staticmethod
    def _rope_scaling(hp: dict[str, Any]) -> dict[str, Any] | None:
        """llama.cpp's rope.scaling.* keys as config.json's rope_scaling (None: plain RoPE);
        a type other than yarn is passed on for the config reader to refuse by name."""
        kind = str(hp.get("rope.scaling.type", "none"))
        if kind == "none":
            return None
        scaling: dict[str, Any] = {"type": kind}
        names = {
            "rope.scaling.factor": "factor",
            "rope.scaling.original_context_length": "original_max_position_embeddings",
            "rope.scaling.yarn_beta_fast": "beta_fast",
            "rope.scaling.yarn_beta_slow": "beta_slow",
        }
        for key, name in names.items():
            if key in hp:
                value = hp[key]
                is_length = name == "original_max_position_embeddings"
                scaling[name] = int(value) if is_length else float(str(np.float32(value)))
        return scaling

    def hf_config(self) -> dict[str, Any]:
        """config.json as transformers would write it for this model."""
        hp = {
            k.removeprefix("qwen2."): v for k, v in self.metadata.items() if k.startswith("qwen2.")
        }
        layers, context = int(hp["block_count"]), int(hp["context_length"])
        bos = self._bos()
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_act": "silu",
            "hidden_size": int(hp["embedding_length"]),
            "intermediate_size": int(hp["feed_forward_length"]),
            "num_hidden_layers": layers,
            "num_attention_heads": int(hp["attention.head_count"]),
            "num_key_value_heads": int(hp["attention.head_count_kv"]),
            # GGUF stores float32; str() of that is its shortest decimal (1e-06, not 9.99e-07).
            "rms_norm_eps": float(str(np.float32(hp["attention.layer_norm_rms_epsilon"]))),
            "rope_theta": float(str(np.float32(hp["rope.freq_base"]))),
            "rope_scaling": self._rope_scaling(hp),
            "max_position_embeddings": context,
            # The embedding is padded past the tokenizer's entries; the model's size rules.
            "vocab_size": self._shapes["model.embed_tokens.weight"][0],
            "tie_word_embeddings": "lm_head.weight" not in self._shapes,
            "torch_dtype": "bfloat16",
            "bos_token_id": bos,
            "eos_token_id": int(self._field("tokenizer.ggml.eos_token_id")),
            "use_cache": True,
            "use_sliding_window": False,
            "sliding_window": context,
            "max_window_layers": layers,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
        }

    def generation_config(self) -> dict[str, Any]:
        """EOS is the file's eos token plus <|endoftext|>, as Qwen2.5's generation_config.json
        lists them (llama.cpp ends generation at both too)."""
        meta = self.metadata
        tokens = meta["tokenizer.ggml.tokens"]
        eos = int(meta["tokenizer.ggml.eos_token_id"])
        bos = self._bos()
        ids = [eos] + [i for i in (_index(tokens, "<|endoftext|>"),) if i not in (None, eos)]
        return {"bos_token_id": bos, "eos_token_id": ids, "pad_token_id": self._pad()}

    def tokenizer_config(self) -> dict[str, Any]:
        meta = self.metadata
        tokens = meta["tokenizer.ggml.tokens"]
        eos = int(meta["tokenizer.ggml.eos_token_id"])
        pad = self._pad()
        return {
            "tokenizer_class": "Qwen2Tokenizer",
            "chat_template": meta.get("tokenizer.chat_template"),
            "bos_token": None,
            "eos_token": tokens[eos],
            "pad_token": None if pad is None else tokens[pad],
            "unk_token": None,
            "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "errors": "replace",
            "split_special_tokens": False,
            "model_max_length": int(self._field("qwen2.context_length")),
        }

    def _bos(self) -> int | None:
        """The file's BOS id. llama.cpp's converter writes none for Qwen2.5's tokenizer, which
        has no BOS token; config.json then says <|endoftext|>, as Qwen2.5's own does."""
        bos = self._field("tokenizer.ggml.bos_token_id")
        if bos is not None:
            return int(bos)
        return _index(self.metadata.get("tokenizer.ggml.tokens", []), "<|endoftext|>")

    def _pad(self) -> int | None:
        pad = self._field("tokenizer.ggml.padding_token_id")
        return self._bos() if pad is None else int(pad)

    def tokenizer(self):
        """The tokenizers.Tokenizer built from the metadata."""
        from nanoqwen.weights.gguf_tokenizer import make_tokenizer

        return make_tokenizer(self.metadata, str(self.path))


def _index(items: list[str], value: str) -> int | None:
    try:
        return items.index(value)
    except ValueError:
        return None
