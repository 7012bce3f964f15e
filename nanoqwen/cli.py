"""The `nanoqwen` command: generate, chat and bench. `nanoqwen COMMAND --help` for details."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
from jinja2.exceptions import TemplateError

from nanoqwen import __version__
from nanoqwen.runtime.attention import BACKENDS
from nanoqwen.runtime.builder import DTYPES
from nanoqwen.runtime.engine import LLM
from nanoqwen.runtime.sampling_params import SamplingParams

PROG = "nanoqwen"
BENCH_MODULE = "nanoqwen.runtime.bench"
COMMANDS = ("generate", "chat", "bench")


class CLIError(Exception):
    """Reported as one line `nanoqwen: error: ...`; exit status `code`."""

    code = 1


class UsageError(CLIError):
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
        help="checkpoint directory, or a Hugging Face repo id already in the local HF cache; "
        "default: weights/Qwen2.5-Coder-0.5B-Instruct (built by tools/make_qwen_coder.py)",
    )
    g.add_argument(
        "--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:N"
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="auto: the checkpoint's dtype on GPU, float32 on CPU",
    )
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=BACKENDS,
        help="auto: flash-attn where it can run (CUDA, float16/bfloat16), else torch",
    )
    g.add_argument("--enforce-eager", action="store_true", help="GPU: no CUDA graphs")
    g.add_argument(
        "--block-size", type=int, default=256, metavar="N", help="KV cache block size (tokens)"
    )
    g.add_argument(
        "--num-kv-blocks", type=int, metavar="N", help="KV cache blocks (default: sized to memory)"
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
        "-q", "--quiet", action="store_true", help="no progress bar, engine log or speed summary"
    )
    return p


def _sampling_flags() -> argparse.ArgumentParser:
    p = _Parser(add_help=False)
    g = p.add_argument_group("sampling (defaults follow Qwen2.5's generation_config)")
    g.add_argument(
        "--max-tokens", type=int, default=512, metavar="N", help="new tokens per answer, at most"
    )
    g.add_argument(
        "--temperature", type=float, default=0.7, metavar="T", help="0 = greedy (deterministic)"
    )
    g.add_argument(
        "--top-p", type=float, default=0.8, metavar="P", help="nucleus mass kept; 1 = off"
    )
    g.add_argument(
        "--top-k", type=int, default=20, metavar="K", help="most likely tokens kept; 0 or -1 = off"
    )
    g.add_argument("--min-p", type=float, default=0.0, metavar="P", help="0 = off")
    g.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R", help="1 = off")
    g.add_argument(
        "--seed", type=int, metavar="N", help="sampling seed, per prompt (default: random)"
    )
    g.add_argument("--stop", action="append", metavar="STR", help="stop at this text (repeatable)")
    g.add_argument("--system", metavar="PROMPT", help="system prompt (chat template only)")
    return p


GENERATE_HELP = """\
Generates an answer for each prompt and streams it to stdout.

Prompts: each PROMPT argument is one prompt (quote it); --file adds one prompt per line (a
.jsonl file: one {"prompt": ...} object per line; `--file -` reads lines from stdin). With
neither, all of stdin is one prompt. The model's chat template is applied unless --no-chat.

Several prompts run as one batch. Answers print in prompt order, each under a
`### i/N: prompt` header: the answer being printed streams live, later ones are buffered
until their turn. --json prints one JSON object per prompt instead (prompt, text,
prompt_tokens, completion_tokens, finish_reason, ttft_s, total_s, tok_per_s =
completion_tokens / total_s; times count from when the batch starts).

A speed summary goes to stderr. Sampling defaults are Qwen2.5's (temperature 0.7, top-p 0.8,
top-k 20); --temperature 0 gives greedy, reproducible output."""

CHAT_HELP = """\
Interactive multi-turn chat with the model's chat template; answers stream as they are made.
Commands: /reset clears the history, /exit (or Ctrl-D) quits. Ctrl-C during an answer stops
that answer and keeps the session; Ctrl-C at the prompt quits."""


def build_parser(with_bench: bool = False) -> argparse.ArgumentParser:
    """with_bench: import nanoqwen.runtime.bench for the bench command's own flags."""
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0], formatter_class=_Formatter)
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
    gen.add_argument("--file", metavar="F", help="prompts, one a line (or .jsonl)")
    gen.add_argument("--no-chat", action="store_true", help="feed prompts as raw text")
    gen.add_argument("--json", action="store_true", help="JSON lines instead of text")
    gen.set_defaults(handler=cmd_generate)

    chat = sub.add_parser(
        "chat",
        parents=[engine, sampling],
        help="interactive chat",
        description=CHAT_HELP,
        formatter_class=_Formatter,
    )
    chat.set_defaults(handler=cmd_chat)

    bench = sub.add_parser(
        "bench",
        help="GPU throughput/latency benchmark (random weights of real Qwen2.5 shapes)",
        description="Benchmarks the engine; see BENCHMARKS.md.",
        formatter_class=_Formatter,
    )
    bench.set_defaults(handler=cmd_bench)
    if with_bench:
        if importlib.util.find_spec(BENCH_MODULE) is None:
            raise CLIError(f"the bench command is not available: {BENCH_MODULE} is missing")
        importlib.import_module(BENCH_MODULE).add_arguments(bench)
    return parser


# ---- shared helpers -------------------------------------------------------------------------
def info(message: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"[{PROG}] {message}", file=sys.stderr, flush=True)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=-1 if args.top_k == 0 else args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            max_tokens=args.max_tokens,
            stop=args.stop,
            seed=args.seed,
        )
    except ValueError as e:  # "top_p=0.0 is out of range: ..." -> "--top-p 0.0 is out ..."
        name, sep, rest = str(e).partition("=")
        message = f"--{name.replace('_', '-')} {rest}" if sep and name.isidentifier() else str(e)
        raise UsageError(message) from None


def load_llm(args: argparse.Namespace) -> LLM:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return LLM(
        args.model,
        device=device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=args.preemption_mode,
        swap_space=args.swap_space,
        progress=not args.quiet,
    )


# ---- generate -------------------------------------------------------------------------------
def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.file is not None:
        prompts += _read_prompt_file(args.file)
    elif not prompts and not sys.stdin.isatty():
        text = sys.stdin.read().rstrip("\n")
        if text.strip():
            prompts.append(text)
    if not prompts:
        raise UsageError("no prompt given: pass PROMPT, --file F, or pipe text on stdin")
    return prompts


def _read_prompt_file(name: str) -> list[str]:
    if name == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(name).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise CLIError(f"--file {name}: no such file") from None
        except OSError as e:
            raise CLIError(f"--file {name}: cannot read it ({e.strerror or e})") from None
    prompts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not name.endswith(".jsonl"):
            prompts.append(line)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CLIError(f"{name}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise CLIError(f'{name}:{lineno}: expected an object with a string "prompt"')
        prompts.append(obj["prompt"])
    if not prompts:
        raise CLIError(f"--file {name} holds no prompts")
    return prompts


def encode_prompt(llm: LLM, prompt: str, args: argparse.Namespace) -> list[int]:
    tok = llm.tokenizer
    if args.no_chat or tok.chat_template is None:
        if args.system is not None:
            why = "--no-chat is set" if args.no_chat else "this model has no chat template"
            raise UsageError(f"--system needs the chat template, but {why}")
        return llm.encode(prompt)
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    return tok.encode_chat([*system, {"role": "user", "content": prompt}])


def _preview(prompt: str, width: int = 60) -> str:
    flat = " ".join(prompt.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


class _Request:
    def __init__(self, prompt: str, prompt_tokens: int) -> None:
        self.prompt = prompt
        self.prompt_tokens = prompt_tokens
        self.pieces: list[str] = []
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.ttft_s: float | None = None
        self.total_s: float | None = None

    def as_json(self) -> dict:
        total = self.total_s or 0.0
        return {
            "prompt": self.prompt,
            "text": "".join(self.pieces),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "ttft_s": round(self.ttft_s or 0.0, 6),
            "total_s": round(total, 6),
            "tok_per_s": round(self.completion_tokens / total, 3) if total > 0 else None,
        }


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    if args.system is not None and args.no_chat:
        raise UsageError("--system needs the chat template, but --no-chat is set")
    prompts = read_prompts(args)
    llm = load_llm(args)
    ids = [encode_prompt(llm, p, args) for p in prompts]
    reqs = [_Request(p, len(i)) for p, i in zip(prompts, ids)]
    n, current, ends_line = len(reqs), 0, True

    def begin(i: int) -> None:  # the text header of answer i, then what is buffered for it
        nonlocal ends_line
        if not args.json and n > 1:
            _write(("\n" if i else "") + f"### {i + 1}/{n}: {_preview(reqs[i].prompt)}\n")
        ends_line = False  # every answer ends with a newline, an empty one too
        emit("".join(reqs[i].pieces))

    def emit(text: str) -> None:
        nonlocal ends_line
        if text and not args.json:
            _write(text)
            ends_line = text.endswith("\n")

    start = time.perf_counter()
    stream = llm.stream(ids, params)
    try:
        begin(0)
        for chunk in stream:
            req = reqs[chunk.index]
            now = time.perf_counter() - start
            if req.ttft_s is None:
                req.ttft_s = now
            req.completion_tokens += len(chunk.token_ids)
            req.pieces.append(chunk.text)
            if chunk.index == current:
                emit(chunk.text)
            if chunk.finished:
                req.finish_reason, req.total_s = chunk.finish_reason, now
            while current < n and reqs[current].finish_reason is not None:
                if args.json:
                    _write(json.dumps(reqs[current].as_json(), ensure_ascii=False) + "\n")
                elif not ends_line:
                    _write("\n")
                current += 1
                if current < n:
                    begin(current)
    finally:
        stream.close()
    _summary(reqs, time.perf_counter() - start, params, args.quiet)
    return 0


def _summary(reqs: list[_Request], wall: float, params: SamplingParams, quiet: bool) -> None:
    done = sum(r.completion_tokens for r in reqs)
    ttfts = [r.ttft_s for r in reqs if r.ttft_s is not None]
    cut = sum(r.finish_reason == "length" for r in reqs)
    parts = [
        f"{len(reqs)} prompt{'s' if len(reqs) > 1 else ''} "
        f"({sum(r.prompt_tokens for r in reqs)} tokens) -> {done} tokens in {wall:.2f} s",
        f"{done / wall if wall > 0 else 0.0:.1f} tok/s",
    ]
    if ttfts:
        parts.append(f"{'mean ' if len(reqs) > 1 else ''}TTFT {sum(ttfts) / len(ttfts):.3f} s")
    if cut:
        parts.append(f"{cut} cut at the length limit (--max-tokens {params.max_tokens})")
    info(", ".join(parts), quiet)


# ---- chat, bench ----------------------------------------------------------------------------
def cmd_chat(args: argparse.Namespace) -> int:
    from nanoqwen.chat import run_chat

    params = sampling_params(args)
    llm = load_llm(args)
    if llm.tokenizer is None or llm.tokenizer.chat_template is None:
        raise CLIError("this model has no chat template: use `nanoqwen generate --no-chat`")
    return run_chat(llm, params, args.system, args.quiet)


def cmd_bench(args: argparse.Namespace) -> int:
    return importlib.import_module(BENCH_MODULE).run(args)


# ---- entry point ----------------------------------------------------------------------------
def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, TemplateError):
        return f"chat template error: {text}"
    if isinstance(e, torch.OutOfMemoryError):
        return f"out of device memory ({text[:200]}): try --num-kv-blocks or fewer prompts"
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(with_bench=argv[:1] == ["bench"]).parse_args(argv)
        if args.command is None:
            raise UsageError(f"no command given: choose generate, chat or bench (see `{PROG} -h`)")
        return int(args.handler(args) or 0)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    except CLIError as e:
        hint = ""
        if isinstance(e, ArgumentError):
            command = argv[0] if argv[:1] and argv[0] in COMMANDS else None
            hint = f" (see `{PROG}{' ' + command if command else ''} --help`)"
        print(f"{PROG}: error: {_one_line(e)}{hint}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `nanoqwen generate ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, OSError, TemplateError, ImportError, torch.OutOfMemoryError) as e:
        # ModelNotFoundError, ConfigError, LoadError and the engine's argument checks.
        # NANOQWEN_DEBUG=1 shows the traceback instead.
        if os.environ.get("NANOQWEN_DEBUG"):
            raise
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 1
