"""The `nanoqwen` command line: its commands, flags, defaults and help texts."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re

from nanoqwen import __version__
from nanoqwen.prompt_input import FORMATS
from nanoqwen.runtime.attention import BACKENDS
from nanoqwen.runtime.builder import DTYPES

PROG = "nanoqwen"
BENCH_MODULE = "nanoqwen.runtime.bench"
COMMANDS = ("generate", "chat", "bench", "serve")
DESCRIPTION = (
    "The `nanoqwen` command: generate, chat and bench. `nanoqwen COMMAND --help` for details."
)


class CLIError(Exception):
    """A failure while running, reported as one line `nanoqwen: error: ...`; exit status 1."""

    code = 1


class UsageError(CLIError):
    """Bad input on the command line; exit status 2, argparse's convention."""

    code = 2


class ArgumentError(UsageError):
    """argparse's complaint about the command line."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):  # no "(default: None/False/[])" noise
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of argparse's usage block
        raise ArgumentError(message)


# ---- parser ---------------------------------------------------------------------------------
def _engine_flags() -> argparse.ArgumentParser:
    p = _Parser(add_help=False)
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
        help="auto: triton (Triton decode kernel, flash-attn prefill) where flash-attn can run "
        "(CUDA, Ampere+, float16/bfloat16, head_dim 64/128, --block-size a multiple of 256), "
        "else torch",
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


def _sampling_flags() -> argparse.ArgumentParser:
    p = _Parser(add_help=False)
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


GENERATE_HELP = """\
Generates an answer for each prompt and streams it to stdout.

Prompts: each PROMPT argument is one prompt (quote it); --file adds one prompt per line, or
one {"prompt": ...} object per line when the file is JSONL (--format; auto: a .jsonl name, or
a first line that is a JSON object); `--file -` reads them from stdin. With neither, all of
stdin is one prompt; stdin text next to PROMPT arguments is refused (use --file -). The
model's chat template (or --chat-template) is applied unless --no-chat.

Several prompts run as one batch. Answers print in prompt order, each under a
`### i/N: prompt` header: the answer being printed streams live, later ones are buffered
until their turn. --json prints one JSON object per prompt instead (prompt, text,
prompt_tokens, completion_tokens, finish_reason, stop_reason, stopped_by, ttft_s, total_s,
tok_per_s = completion_tokens / total_s; times count from when the batch starts).

A speed summary goes to stderr. Sampling defaults come from the checkpoint's
generation_config.json, else Qwen2.5-Instruct's (temperature 0.7, top-p 0.8, top-k 20,
repetition penalty 1.05); --temperature 0 gives greedy, reproducible output. With --json,
--logprobs N adds each token's log-probability, rank and N alternatives."""

CHAT_HELP = """\
Interactive multi-turn chat with the model's chat template; answers stream as they are made.
Commands: /reset clears the history, /exit (or Ctrl-D) quits. Ctrl-C during an answer stops
that answer and keeps the session; Ctrl-C at the prompt quits."""


def build_parser(with_bench: bool = False) -> argparse.ArgumentParser:
    """with_bench: import nanoqwen.runtime.bench for the bench command's own flags."""
    parser = _Parser(prog=PROG, description=DESCRIPTION, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    engine, sampling = _engine_flags(), _sampling_flags()

    gen = sub.add_parser(
        "generate",
        parents=[engine, sampling],
        help="generate text for one or more prompts",
        description=GENERATE_HELP,
        formatter_class=_Formatter,
    )
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text")
    gen.add_argument("--file", metavar="F", help="prompts, one a line (or JSONL); - is stdin")
    gen.add_argument(
        "--format",
        choices=FORMATS,
        default="auto",
        help="--file's format (auto: by name or content)",
    )
    gen.add_argument("--no-chat", action="store_true", help="feed prompts as raw text")
    gen.add_argument("--json", action="store_true", help="JSON lines instead of text")
    gen.set_defaults(command_name="generate")

    chat = sub.add_parser(
        "chat",
        parents=[engine, sampling],
        help="interactive chat",
        description=CHAT_HELP,
        formatter_class=_Formatter,
    )
    chat.set_defaults(command_name="chat")

    bench = sub.add_parser(
        "bench",
        help="GPU throughput/latency benchmark (random weights of real Qwen2.5 shapes)",
        description="Benchmarks the engine; see BENCHMARKS.md.",
        formatter_class=_Formatter,
    )
    bench.set_defaults(command_name="bench")

    from nanoqwen.serve import args as serve_args  # argparse only: no server libraries

    serve = sub.add_parser(
        "serve",
        parents=[engine],
        help="OpenAI-compatible HTTP server (needs the serve extra)",
        description=serve_args.SERVE_HELP,
        formatter_class=_Formatter,
        conflict_handler="resolve",
    )
    serve_args.add_arguments(serve)
    serve.set_defaults(command_name="serve")
    if with_bench:
        if importlib.util.find_spec(BENCH_MODULE) is None:
            raise CLIError(f"the bench command is not available: {BENCH_MODULE} is missing")
        importlib.import_module(BENCH_MODULE).add_arguments(bench)
    return parser


def flag_spelling(message: str) -> str:
    """The library's parameter names as the CLI's flags: 'block_size=3 is ...' becomes
    '--block-size 3 is ...', a bare 'max_model_len' becomes '--max-model-len'."""
    for name in _FLAG_PARAMS:
        flag = "--" + name.replace("_", "-")
        message = re.sub(rf"(?<![\w./-]){name}=", f"{flag} ", message)
        if "_" in name:  # a plain word like "stop" or "seed" is left alone
            message = re.sub(rf"(?<![\w./-]){name}\b", flag, message)
    return message


# API parameters that a generate/chat/bench flag sets under the same name.
_FLAG_PARAMS = (
    "attention_backend", "block_size", "device", "dtype", "enforce_eager", "quantization",
    "gpu_memory_utilization", "max_model_len", "max_num_batched_tokens", "max_num_seqs",
    "num_kv_blocks", "frequency_penalty", "ignore_eos", "logprobs", "max_tokens", "min_p",
    "min_tokens",
    "presence_penalty", "repetition_penalty", "seed", "stop_token_ids", "stop", "temperature",
    "top_k", "top_p", "tensor_parallel_size",
)  # fmt: skip
