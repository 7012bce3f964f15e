"""How nanoqwen fails: InvalidInputError for bad input at every boundary, EngineError for a
failure while running, and each failure as one line with an exit status (what the CLI prints
and the serving engine process reports)."""

from __future__ import annotations

import os

import torch
from jinja2.exceptions import TemplateError


class InvalidInputError(ValueError):
    """Bad input: a checkpoint file, an engine argument, a sampling parameter, a prompt or a
    command-line flag. The message is one line that names the file or parameter, the value
    and what is allowed, so a front end can show it as it is: the CLI prints it and exits 2,
    the HTTP server answers 400 with it. `param` is the parameter's API name, when one is to
    blame, so a front end can respell it (the CLI says --block-size for block_size).

    A subclass of ValueError, so `except ValueError` keeps working."""

    def __init__(self, message: str, param: str | None = None) -> None:
        message = " ".join(str(message).split())  # one line, whatever went into it
        super().__init__(message)
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return self.message


class EngineError(RuntimeError):
    """The engine failed while loading or running (exit status 1); the message is one line."""


def debug() -> bool:
    """NANOQWEN_DEBUG=1 (or true, yes, on) shows tracebacks; 0, false or empty does not."""
    return os.environ.get("NANOQWEN_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def exit_code(e: BaseException) -> int:
    """2 for bad input (argparse's convention), 1 for a failure while running."""
    code = getattr(e, "code", None)
    if isinstance(code, int):
        return code
    return 2 if isinstance(e, InvalidInputError) else 1


def one_line(e: BaseException) -> str:
    """The failure as one line: the message itself for the errors nanoqwen words, else the
    exception's type and the start of its message."""
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, TemplateError):
        return f"chat template error: {text}"
    if isinstance(e, torch.OutOfMemoryError):
        return f"out of device memory ({text[:200]}): try --num-kv-blocks or fewer prompts"
    if not isinstance(e, (InvalidInputError, EngineError, OSError)):
        return f"{type(e).__name__}: {text[:300]}"
    return text
