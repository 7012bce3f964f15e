"""`nanoqwen generate`: answers for a batch of prompts, streamed in prompt order as text or
JSON lines, and a speed summary on stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time

from nanoqwen.cli.engine import chat_template, load_llm, sampling_params
from nanoqwen.cli.errors import UsageError
from nanoqwen.cli.parser import PROG
from nanoqwen.cli.prompt_input import read_prompts
from nanoqwen.runtime.engine import LLM
from nanoqwen.runtime.logprobs import TokenLogprobs
from nanoqwen.runtime.sampling_params import SamplingParams


def info(message: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"[{PROG}] {message}", file=sys.stderr, flush=True)


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
