"""The `nanoqwen` command: generate, chat and bench. `nanoqwen COMMAND --help` for details."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from jinja2.exceptions import TemplateError

from nanoqwen.cli_parser import (
    BENCH_MODULE,
    COMMANDS,
    PROG,
    ArgumentError,
    CLIError,
    UsageError,
    build_parser,
    flag_spelling,
)
from nanoqwen.errors import InvalidInputError
from nanoqwen.prompt_input import read_prompts
from nanoqwen.runtime.engine import LLM
from nanoqwen.runtime.logprobs import TokenLogprobs
from nanoqwen.runtime.sampling_params import SamplingParams
from nanoqwen.validation import read_text
from nanoqwen.weights.generation_config import FIELDS, sampling_defaults
from nanoqwen.weights.hub import resolve_model
from nanoqwen.weights.tokenizer import compile_chat_template


# ---- shared helpers -------------------------------------------------------------------------
def info(message: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"[{PROG}] {message}", file=sys.stderr, flush=True)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """From the flags, and the checkpoint's generation_config.json for those not given."""
    try:
        defaults = sampling_defaults(resolve_model(args.model))
    except (ValueError, FileNotFoundError):
        defaults = sampling_defaults(None)  # loading the model reports what is wrong
    given = {k: getattr(args, k) for k in FIELDS if getattr(args, k) is not None}
    chosen = {"min_p": 0.0} | defaults | given
    return SamplingParams(
        temperature=chosen["temperature"],
        top_p=chosen["top_p"],
        top_k=-1 if chosen["top_k"] == 0 else chosen["top_k"],
        min_p=chosen["min_p"],
        repetition_penalty=chosen["repetition_penalty"],
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        stop=args.stop,
        stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        logprobs=args.logprobs,
    )


def chat_template(args: argparse.Namespace) -> str | None:
    """--chat-template's text, checked before the model loads: a file, else the text itself
    when it looks like a template."""
    value = args.chat_template
    if value is None:
        return None
    if not Path(value).exists() and ("{{" in value or "{%" in value):
        text, source = value, "--chat-template"
    else:
        text, source = read_text(value, "--chat-template"), f"--chat-template {value}"
    compile_chat_template(text, source)
    return text


def load_llm(args: argparse.Namespace, template: str | None = None) -> LLM:
    """The engine the flags describe (`serve` and its benchmark add --random-shape)."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    random_shape = getattr(args, "random_shape", None)
    llm = LLM(
        None if random_shape else args.model,
        device=device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=args.preemption_mode,
        swap_space=args.swap_space,
        random_shape=random_shape,
        progress=not args.quiet,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        quantization=getattr(args, "quantization", "auto"),
    )
    if template is not None:
        llm.tokenizer.set_chat_template(template, "--chat-template")
    return llm


def stopped_by(
    finish_reason: str | None,
    stop_reason: int | str | None,
    length: int,
    max_model_len: int,
    completion_tokens: int,
    max_tokens: int,
) -> str | None:
    """Why an answer ended, in one word: eos, stop_token, stop_string, max_tokens or
    max_model_len (the context length)."""
    if finish_reason == "stop":
        if stop_reason is None:
            return "eos"
        return "stop_token" if isinstance(stop_reason, int) else "stop_string"
    if finish_reason == "length":
        cut_by_context = length >= max_model_len and completion_tokens < max_tokens
        return "max_model_len" if cut_by_context else "max_tokens"
    return finish_reason


# ---- generate -------------------------------------------------------------------------------
def encode_prompt(llm: LLM, prompt: str, args: argparse.Namespace) -> list[int]:
    tok = llm.tokenizer
    if args.no_chat or tok.chat_template is None:
        if args.system is not None:  # --no-chat with --system is refused before loading
            raise UsageError(
                "--system needs a chat template, but this model has none: give one with "
                "--chat-template"
            )
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
        self.stop_reason: int | str | None = None
        self.stopped_by: str | None = None
        self.ttft_s: float | None = None
        self.total_s: float | None = None
        self.logprobs: list[TokenLogprobs] | None = None

    def as_json(self, tokenizer) -> dict:
        total = self.total_s or 0.0
        extra = {}
        if self.logprobs is not None:
            extra["logprobs"] = [_logprob_json(e, tokenizer) for e in self.logprobs]
        return {
            "prompt": self.prompt,
            "text": "".join(self.pieces),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "stopped_by": self.stopped_by,
            "ttft_s": round(self.ttft_s or 0.0, 6),
            "total_s": round(total, 6),
            "tok_per_s": round(self.completion_tokens / total, 3) if total > 0 else None,
        } | extra


def _logprob_json(entry: TokenLogprobs, tokenizer) -> dict:
    def token(t: int) -> str:
        return tokenizer.decode([t])

    return {
        "token_id": entry.token_id,
        "token": token(entry.token_id),
        "logprob": entry.logprob,
        "rank": entry.rank,
        "top": [{"token_id": t, "token": token(t), "logprob": lp} for t, lp in entry.top],
    }


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_generate(args: argparse.Namespace) -> int:
    # Every check that needs no model runs first, so a typo costs no loading time.
    params = sampling_params(args)
    if args.no_chat and args.system is not None:
        raise UsageError("--system needs the chat template, but --no-chat is set")
    if args.no_chat and args.chat_template is not None:
        raise UsageError("--chat-template is unused with --no-chat: drop one of them")
    template = chat_template(args)
    prompts = read_prompts(args.prompts, args.file, args.format)
    llm = load_llm(args, template)
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
            if chunk.logprobs is not None:
                req.logprobs = (req.logprobs or []) + chunk.logprobs
            req.pieces.append(chunk.text)
            if chunk.index == current:
                emit(chunk.text)
            if chunk.finished:
                req.finish_reason, req.stop_reason, req.total_s = (
                    chunk.finish_reason,
                    chunk.stop_reason,
                    now,
                )
                req.stopped_by = stopped_by(
                    chunk.finish_reason,
                    chunk.stop_reason,
                    req.prompt_tokens + req.completion_tokens,
                    llm.max_model_len,
                    req.completion_tokens,
                    params.max_tokens,
                )
            while current < n and reqs[current].finish_reason is not None:
                if args.json:
                    _write(
                        json.dumps(reqs[current].as_json(llm.tokenizer), ensure_ascii=False) + "\n"
                    )
                elif not ends_line:
                    _write("\n")
                current += 1
                if current < n:
                    begin(current)
    finally:
        stream.close()
    _summary(reqs, time.perf_counter() - start, params, llm.max_model_len, args.quiet)
    return 0


def _summary(
    reqs: list[_Request], wall: float, params: SamplingParams, max_model_len: int, quiet: bool
) -> None:
    done = sum(r.completion_tokens for r in reqs)
    ttfts = [r.ttft_s for r in reqs if r.ttft_s is not None]
    parts = [
        f"{len(reqs)} prompt{'s' if len(reqs) > 1 else ''} "
        f"({sum(r.prompt_tokens for r in reqs)} tokens) -> {done} tokens in {wall:.2f} s",
        f"{done / wall if wall > 0 else 0.0:.1f} tok/s",
    ]
    if ttfts:
        parts.append(f"{'mean ' if len(reqs) > 1 else ''}TTFT {sum(ttfts) / len(ttfts):.3f} s")
    cut = sum(r.stopped_by == "max_tokens" for r in reqs)
    if cut:
        parts.append(f"{cut} cut at --max-tokens {params.max_tokens}")
    full = sum(r.stopped_by == "max_model_len" for r in reqs)
    if full:
        parts.append(f"{full} cut at the context length (--max-model-len {max_model_len})")
    info(", ".join(parts), quiet)


# ---- chat, bench ----------------------------------------------------------------------------
def cmd_chat(args: argparse.Namespace) -> int:
    from nanoqwen.chat import run_chat

    params = sampling_params(args)
    template = chat_template(args)
    llm = load_llm(args, template)
    if llm.tokenizer is None or llm.tokenizer.chat_template is None:
        raise UsageError(
            "this model has no chat template: give one with --chat-template, or use "
            "`nanoqwen generate --no-chat`"
        )
    return run_chat(llm, params, args.system, args.quiet)


def cmd_bench(args: argparse.Namespace) -> int:
    return importlib.import_module(BENCH_MODULE).run(args)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from nanoqwen.serve.server import run_server
    except ImportError as e:
        raise CLIError(
            f"`{PROG} serve` needs the serve extra ({e.name or e} is missing): "
            "pip install 'nanoqwen[serve]'"
        ) from None
    return run_server(args)


# ---- entry point ----------------------------------------------------------------------------
def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, TemplateError):
        return f"chat template error: {text}"
    if isinstance(e, torch.OutOfMemoryError):
        return f"out of device memory ({text[:200]}): try --num-kv-blocks or fewer prompts"
    if not isinstance(e, (CLIError, InvalidInputError, OSError)):
        return f"{type(e).__name__}: {text[:300]}"
    return text


def debug() -> bool:
    """NANOQWEN_DEBUG=1 (or true, yes, on) shows tracebacks; 0, false or empty does not."""
    return os.environ.get("NANOQWEN_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(with_bench=argv[:1] == ["bench"]).parse_args(argv)
        if args.command is None:
            raise UsageError(
                f"no command given: choose generate, chat, bench or serve (see `{PROG} -h`)"
            )
        handlers = {
            "generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench, "serve": cmd_serve
        }  # fmt: skip
        return int(handlers[args.command_name](args) or 0)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `nanoqwen generate ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:
        if debug():
            raise
        code, message = error_line(e)
        hint = ""
        if isinstance(e, ArgumentError):
            command = argv[0] if argv[:1] and argv[0] in COMMANDS else None
            hint = f" (see `{PROG}{' ' + command if command else ''} --help`)"
        print(f"{PROG}: error: {message}{hint}", file=sys.stderr)
        return code


def error_line(e: Exception) -> tuple[int, str]:
    """The exit status and one-line message for a failure (also the serve engine process's)."""
    # Bad input (a flag, value, prompt or file: InvalidInputError, argparse's complaints)
    # exits 2; a failure while running (memory, the device, a template's own error) 1.
    code = e.code if isinstance(e, CLIError) else 2 if isinstance(e, InvalidInputError) else 1
    message = _one_line(e)
    if isinstance(e, InvalidInputError):
        message = flag_spelling(message)
    return code, message
