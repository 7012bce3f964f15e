"""How the `nanoqwen` command fails: its error types, and each failure as one line
`nanoqwen: error: ...` with an exit status (also the serve engine process's)."""

from __future__ import annotations

import os
import re

import torch
from jinja2.exceptions import TemplateError

from nanoqwen.errors import InvalidInputError


class CLIError(Exception):
    """A failure while running, reported as one line `nanoqwen: error: ...`; exit status 1."""

    code = 1


class UsageError(CLIError):
    """Bad input on the command line; exit status 2, argparse's convention."""

    code = 2


class ArgumentError(UsageError):
    """argparse's complaint about the command line."""


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


def error_line(e: Exception) -> tuple[int, str]:
    """The exit status and one-line message for a failure (also the serve engine process's)."""
    # Bad input (a flag, value, prompt or file: InvalidInputError, argparse's complaints)
    # exits 2; a failure while running (memory, the device, a template's own error) 1.
    code = e.code if isinstance(e, CLIError) else 2 if isinstance(e, InvalidInputError) else 1
    message = _one_line(e)
    if isinstance(e, InvalidInputError):
        message = flag_spelling(message)
    return code, message


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
