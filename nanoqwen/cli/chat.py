"""`nanoqwen chat`: an interactive multi-turn chat loop over LLM.stream."""

from __future__ import annotations

import contextlib
import sys
import time

from nanoqwen.cli.flags import flag_spelling
from nanoqwen.runtime.engine import LLM
from nanoqwen.runtime.sampling_params import SamplingParams

COMMANDS = "/reset clears the history, /exit or Ctrl-D quits, Ctrl-C stops an answer"


def _note(message: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"[nanoqwen] {message}", file=sys.stderr, flush=True)


def _read_line(interactive: bool) -> str | None:
    """The next user line; None at EOF or Ctrl-C."""
    try:
        return input(">>> " if interactive else "")
    except (EOFError, KeyboardInterrupt):
        if interactive:
            print()  # end the prompt line
        return None


def _answer(llm: LLM, ids: list[int], params: SamplingParams, quiet: bool) -> tuple[str, bool]:
    """Streams one answer to stdout; returns (its text, whether Ctrl-C cut it short)."""
    pieces: list[str] = []
    tokens, first, reason, interrupted = 0, None, None, False
    start = time.perf_counter()
    stream = llm.stream([ids], params)
    try:
        for chunk in stream:
            first = first if first is not None else time.perf_counter() - start
            tokens += len(chunk.token_ids)
            reason = chunk.finish_reason
            pieces.append(chunk.text)
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        stream.close()  # aborts the request if it is still running
    text = "".join(pieces)
    if not text.endswith("\n"):
        sys.stdout.write("\n")
        sys.stdout.flush()
    wall = time.perf_counter() - start
    if interrupted:
        _note("answer stopped (Ctrl-C)")
    elif reason == "length" and len(ids) + tokens >= llm.max_model_len:
        _note(
            f"answer cut at the context length (--max-model-len {llm.max_model_len}): "
            "/reset starts a new conversation",
            quiet,
        )
    elif reason == "length":
        _note(f"answer cut at --max-tokens {params.max_tokens}", quiet)
    if first is not None:
        _note(f"{tokens} tokens, {tokens / wall:.1f} tok/s, TTFT {first:.3f} s", quiet)
    return text, interrupted


def run_chat(llm: LLM, params: SamplingParams, system: str | None, quiet: bool) -> int:
    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
    _note(f"chat: {COMMANDS}", quiet or not interactive)
    head = [{"role": "system", "content": system}] if system is not None else []
    history: list[dict[str, str]] = []
    while True:
        line = _read_line(interactive)
        if line is None:
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history.clear()
            _note("history cleared", quiet)
            continue
        if text.startswith("/") and " " not in text:
            _note(f"unknown command {text}: {COMMANDS}")
            continue
        history.append({"role": "user", "content": line})
        try:
            ids = llm.tokenizer.encode_chat(head + history)
            answer, _ = _answer(llm, ids, params, quiet)
        except ValueError as e:  # e.g. the conversation no longer fits max_model_len
            history.pop()
            _note(f"error: {flag_spelling(str(e))}; /reset starts a new conversation")
            continue
        # A stopped answer stays in the history as far as it got, as it is on screen.
        history.append({"role": "assistant", "content": answer})
