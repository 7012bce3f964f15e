"""The flags that several `nanoqwen` commands share: model and engine, and sampling."""

from __future__ import annotations

import argparse

from nanoqwen.attention.backends import BACKENDS
from nanoqwen.cli.errors import ArgumentError
from nanoqwen.runtime.device_choice import DTYPES


class Parser(argparse.ArgumentParser):
    """Raises ArgumentError (one line) where argparse prints its usage block and exits."""

    def error(self, message: str):
        raise ArgumentError(message)


def engine_flags() -> argparse.ArgumentParser:
    p = Parser(add_help=False)
    g = p.add_argument_group("model and engine")
    g.add_argument(
        "--model",
        help="checkpoint directory, a Qwen2 .gguf file, or a Hugging Face repo id (from the "
        "local HF cache, else downloaded unless HF_HUB_OFFLINE is set); default: "
        "weights/Qwen2.5-Coder-0.5B-Instruct (built by tools/make_qwen_coder.py)",
    )
    g.add_argument(
        "--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:N"
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="auto: the checkpoint's dtype on GPU; on CPU bfloat16 where the CPU has bf16 "
        "instructions (float32 for float32 checkpoints)",
    )
    g.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="weight-only quantized linear layers; auto: a .gguf stays quantized (its Q4_K "
        "tensors int4; Q5_0/Q8_0 as they are on an AVX512-VNNI CPU with bf16 activations, "
        "else int8 per channel), and without --model the CPU runs the default model's GGUF "
        "unless --dtype is float32; other checkpoints load as they are; none: float weights",
    )
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=BACKENDS,
        help="auto: triton on a CUDA GPU (Ampere+, float16/bfloat16, head_dim 64/128; with "
        "flash-attn's prefill where it imports and --block-size is a multiple of 256), native "
        "(C decode kernels) on a CPU in bfloat16, else torch",
    )
    g.add_argument("--enforce-eager", action="store_true", help="GPU: no CUDA graphs")
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N processes: N GPUs (NCCL), or CPU processes (gloo)",
    )
    g.add_argument(
        "--block-size", type=int, default=256, metavar="N", help="KV cache block size (tokens)"
    )
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        metavar="N",
        help="KV cache blocks (default: 1 GiB on CPU; on GPU what --gpu-memory-utilization leaves)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="longest sequence, prompt plus answer (default: the model's "
        "max_position_embeddings, or what the KV cache holds if less)",
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=256, metavar="N", help="sequences in one batch, at most"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        metavar="N",
        help="tokens in one step, at most (longer prompts prefill in chunks)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="F",
        help="GPU: fraction of the GPU's memory for weights, activations and KV cache",
    )
    g.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="recompute every prompt instead of reusing cached KV blocks of earlier prompts",
    )
    g.add_argument(
        "--preemption-mode",
        default="swap",
        choices=["swap", "recompute"],
        help="when the KV cache runs short: copy a sequence's blocks to host memory and back, "
        "or drop them and recompute (swap falls back to recompute when the host pool is full)",
    )
    g.add_argument(
        "--swap-space",
        type=float,
        default=4.0,
        metavar="GIB",
        help="host memory for swapped-out and evicted cached KV blocks (pinned on CUDA); 0 = none",
    )
    g.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template (a file, or the template text itself) to use instead of "
        "the model's",
    )
    g.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar, engine log or speed summary"
    )
    return p


def _token_id_list(text: str) -> list[int]:
    """--stop-token-ids 151643,151645"""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid token id list: {text!r} (allowed comma-separated integers)"
        ) from None


def sampling_flags() -> argparse.ArgumentParser:
    p = Parser(add_help=False)
    g = p.add_argument_group(
        "sampling (defaults marked * come from the checkpoint's generation_config.json, and "
        "where it names none from Qwen2.5-Instruct's: temperature 0.7, top-p 0.8, top-k 20, "
        "repetition penalty 1.05)"
    )
    g.add_argument(
        "--max-tokens", type=int, default=512, metavar="N", help="new tokens per answer, at most"
    )
    g.add_argument("--temperature", type=float, metavar="T", help="* 0 = greedy (deterministic)")
    g.add_argument("--top-p", type=float, metavar="P", help="* nucleus mass kept; 1 = off")
    g.add_argument(
        "--top-k", type=int, metavar="K", help="* most likely tokens kept; 0 or -1 = off"
    )
    g.add_argument("--min-p", type=float, metavar="P", help="* 0 = off (default 0)")
    g.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        metavar="N",
        help="new tokens before EOS, a stop token or a stop string may end an answer",
    )
    g.add_argument("--repetition-penalty", type=float, metavar="R", help="* 1 = off")
    g.add_argument(
        "--presence-penalty", type=float, default=0.0, metavar="F", help="-2..2; 0 = off"
    )
    g.add_argument(
        "--frequency-penalty", type=float, default=0.0, metavar="F", help="-2..2; 0 = off"
    )
    g.add_argument(
        "--seed", type=int, metavar="N", help="sampling seed, per prompt (default: random)"
    )
    g.add_argument("--stop", action="append", metavar="STR", help="stop at this text (repeatable)")
    g.add_argument(
        "--stop-token-ids",
        type=_token_id_list,
        action="extend",
        metavar="IDS",
        help="stop at these token ids, comma-separated (repeatable)",
    )
    g.add_argument("--ignore-eos", action="store_true", help="go on past EOS, up to --max-tokens")
    g.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help="with --json: each token's log-probability, rank and the N most likely (0..20)",
    )
    g.add_argument("--system", metavar="PROMPT", help="system prompt (chat template only)")
    return p
