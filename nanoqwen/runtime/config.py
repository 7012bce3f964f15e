"""EngineConfig: every setting of an engine, in one dataclass checked once when it is made.

LLM, the builder, tensor-parallel workers, the serving engine process, the CLI and the
benchmarks all take it. Each field's metadata holds its command-line help
(runtime/config_flags.py makes the engine flags from these fields), so a setting is named
in this file and nowhere else."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from nanoqwen.attention.backends import BACKENDS
from nanoqwen.errors import InvalidInputError
from nanoqwen.model.shapes import SHAPES
from nanoqwen.quant.scheme import QUANTIZATIONS
from nanoqwen.runtime.device_choice import DTYPES
from nanoqwen.runtime.scheduler import PREEMPTION_MODES
from nanoqwen.runtime.spec.config import SpeculativeConfig
from nanoqwen.validation import (
    boolean,
    choice,
    integer,
    invalid,
    number,
    optional_integer,
)


def _setting(default, help: str, **cli):
    """A field with its flag's help; cli: argparse's type/metavar/choices, or flag=None for a
    setting with no engine flag of its own (the CLI derives it from another flag)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class EngineConfig:
    model: str | os.PathLike | None = _setting(
        None,
        "checkpoint directory, a Qwen2 .gguf file, or a Hugging Face repo id (from the local "
        "HF cache, else downloaded unless HF_HUB_OFFLINE is set); default: "
        "weights/Qwen2.5-Coder-0.5B-Instruct (built by tools/make_qwen_coder.py)",
        type=str,
    )
    device: str = _setting(
        "cpu",
        "auto (cuda when available, else cpu), cpu, cuda, cuda:N",
        cli_default="auto",
    )
    dtype: str = _setting(
        "auto",
        "auto: the checkpoint's dtype on GPU; on CPU bfloat16 where the CPU has bf16 "
        "instructions or the GGUF kernels run a GGUF model (float32 for float32 checkpoints)",
        choices=("auto", *DTYPES),
    )
    quantization: str = _setting(
        "auto",
        "weight-only quantized linear layers; auto: a .gguf stays quantized (its Q4_K tensors "
        "int4; Q5_0/Q8_0 as they are on an AVX2 or AVX-512 CPU with bf16 activations, else int8 "
        "per channel), and without --model the CPU runs the default model's GGUF unless "
        "--dtype is float32; other checkpoints load as they are; none: float weights",
        choices=QUANTIZATIONS,
    )
    attention_backend: str = _setting(
        "auto",
        "auto: triton on a CUDA GPU (Ampere+, float16/bfloat16, head_dim 64/128; with "
        "flash-attn's prefill where it imports and --block-size is a multiple of 256), native "
        "(C decode kernels) on a CPU in bfloat16, else torch",
        choices=BACKENDS,
    )
    enforce_eager: bool = _setting(False, "GPU: no CUDA graphs")
    tensor_parallel_size: int = _setting(
        1, "split the model over N processes: N GPUs (NCCL), or CPU processes (gloo)"
    )
    block_size: int = _setting(256, "KV cache block size (tokens)")
    num_kv_blocks: int | None = _setting(
        None,
        "KV cache blocks (default: 1 GiB on CPU; on GPU what --gpu-memory-utilization leaves)",
        type=int,
    )
    max_model_len: int | None = _setting(
        None,
        "longest sequence, prompt plus answer (default: the model's max_position_embeddings, "
        "with YaRN rope_scaling its original context x factor, or what the KV cache holds if "
        "less)",
        type=int,
    )
    kv_cache_dtype: str = _setting(
        "auto",
        "auto: the model's dtype; fp8 (or fp8_e4m3): float8 e4m3 keys and values with scale "
        "1, as vLLM defaults to (twice the tokens in the same memory; the GPU's Triton "
        "attention only)",
        choices=("auto", "fp8", "fp8_e4m3"),
    )
    max_num_seqs: int = _setting(256, "sequences in one batch, at most")
    max_num_batched_tokens: int = _setting(
        8192, "tokens in one step, at most (longer prompts prefill in chunks)"
    )
    gpu_memory_utilization: float = _setting(
        0.9, "GPU: fraction of the GPU's memory for weights, activations and KV cache"
    )
    enable_prefix_caching: bool = _setting(
        True,
        "recompute every prompt instead of reusing cached KV blocks of earlier prompts",
        flag="--no-prefix-caching",
    )
    preemption_mode: str = _setting(
        "swap",
        "when the KV cache runs short: copy a sequence's blocks to host memory and back, or "
        "drop them and recompute (swap falls back to recompute when the host pool is full)",
        choices=PREEMPTION_MODES,
    )
    swap_space: float = _setting(
        4.0,
        "host memory for swapped-out and evicted cached KV blocks (pinned on CUDA); 0 = none",
        metavar="GIB",
    )
    speculative_config: SpeculativeConfig | None = _setting(
        None,
        "speculative decoding, as JSON (or a dict in Python): prompt lookup with "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 4}, or a draft model with {"method": "draft", "model": PATH, '
        '"num_speculative_tokens": 4}; greedy output is unchanged and sampled output keeps '
        "its distribution (docs/speculative-decoding.md)",
        type=str,
        metavar="JSON",
    )
    random_shape: str | None = _setting(
        None,
        "random weights of this Qwen2.5 shape instead of a checkpoint (for benchmarks; no "
        "tokenizer: prompts must be token ids)",
        choices=SHAPES,
        flag=None,
    )
    progress: bool = _setting(True, "progress bars and the engine's log on stderr", flag=None)

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise invalid(
                "model", self.model, "is not a path", "None, a checkpoint directory or a hub id"
            )
        if not isinstance(self.device, str):
            raise invalid("device", self.device, "is not a string", "auto, cpu, cuda, cuda:N")
        choice("dtype", self.dtype, ["auto", *DTYPES])
        choice("quantization", self.quantization, QUANTIZATIONS)
        choice("attention_backend", self.attention_backend, BACKENDS)
        boolean("enforce_eager", self.enforce_eager)
        integer(
            "tensor_parallel_size", self.tensor_parallel_size, lambda v: v >= 1, "an integer >= 1"
        )
        integer(
            "block_size",
            self.block_size,
            lambda v: 1 <= v <= 1 << 16 and not v & (v - 1),
            "a power of two from 1 to 65536",
        )
        optional_integer("num_kv_blocks", self.num_kv_blocks, lambda v: v >= 1, "an integer >= 1")
        optional_integer("max_model_len", self.max_model_len, lambda v: v >= 2, "an integer >= 2")
        choice("kv_cache_dtype", self.kv_cache_dtype, ["auto", "fp8", "fp8_e4m3"])
        integer("max_num_seqs", self.max_num_seqs, lambda v: v >= 1, "an integer >= 1")
        integer(
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            lambda v: v >= 1,
            "an integer >= 1",
        )
        number(
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            lambda v: 0 < v <= 1,
            "a number in (0, 1]",
        )
        boolean("enable_prefix_caching", self.enable_prefix_caching)
        choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        number("swap_space", self.swap_space, lambda v: v >= 0, "a number of GiB >= 0")
        spec = SpeculativeConfig.of(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)  # a dict or JSON in, checked out
        if spec is not None and self.tensor_parallel_size > 1:
            raise invalid(
                "speculative_config", self.speculative_config,
                f"is not supported with tensor_parallel_size={self.tensor_parallel_size}",
                "None with tensor parallelism",
            )  # fmt: skip
        if self.random_shape is not None:
            choice("random_shape", self.random_shape, SHAPES)
        boolean("progress", self.progress)

    @classmethod
    def of(cls, model=None, **options) -> EngineConfig:
        """EngineConfig(model, **options), with an unknown option named as bad input."""
        known = {f.name for f in fields(cls)}
        for name in options:
            if name not in known:
                raise InvalidInputError(
                    f"unknown engine option {name!r}: allowed {', '.join(sorted(known))}",
                    param=name,
                )
        return cls(model=model, **options)
