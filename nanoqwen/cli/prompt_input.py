"""Where `nanoqwen generate` gets its prompts: PROMPT arguments, --file (text or JSONL), stdin."""

from __future__ import annotations

import dataclasses
import json
import sys

from nanoqwen.cli.errors import UsageError
from nanoqwen.errors import InvalidInputError
from nanoqwen.runtime.sampling_params import SamplingParams
from nanoqwen.validation import read_text

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))

FORMATS = ("auto", "text", "jsonl")


def read_stdin() -> str:
    """All of stdin, decoded as UTF-8 with a one-line error naming the bad byte."""
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInputError(
            f"stdin is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None


def is_jsonl(name: str, text: str, fmt: str) -> bool:
    """auto: a .jsonl file name, or a first non-empty line that is a JSON object."""
    if fmt != "auto":
        return fmt == "jsonl"
    if name.endswith(".jsonl"):
        return True
    first = next((line for line in text.splitlines() if line.strip()), "")
    if not first.lstrip().startswith("{"):
        return False
    try:
        return isinstance(json.loads(first), dict)
    except json.JSONDecodeError:
        return False


def parse_prompt_lines(name: str, text: str, fmt: str) -> list[str]:
    """One prompt per non-empty line, or one {"prompt": ...} object per line (JSONL)."""
    label = "stdin" if name == "-" else name
    jsonl = is_jsonl(name, text, fmt)
    prompts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not jsonl:
            prompts.append(line)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidInputError(f"{label}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise InvalidInputError(
                f'{label}:{lineno}: expected an object with a string "prompt" (JSONL)'
            )
        settings = sorted(set(obj) & SAMPLING_FIELDS)
        if settings:  # dropped, it would look obeyed; other keys (ids, metadata) are let be
            # (a UsageError: the key is quoted as written, not respelled as a flag)
            raise UsageError(
                f'{label}:{lineno}: key "{settings[0]}" is a sampling parameter, which a line '
                "cannot set: the sampling flags apply to every prompt"
            )
        prompts.append(obj["prompt"])
    if not prompts:
        raise InvalidInputError(f"--file {name} holds no prompts")
    return prompts


def read_prompts(arguments: list[str], file: str | None, fmt: str) -> list[str]:
    """The prompts of a generate command line. Text piped on stdin is one prompt when nothing
    else gives prompts; piped next to PROMPT arguments or a --file it would be dropped, so
    that is refused instead (`--file -` reads it as prompts alongside the arguments)."""
    prompts = list(arguments)
    if file is not None:
        text = read_stdin() if file == "-" else read_text(file, "--file")
        prompts += parse_prompt_lines(file, text, fmt)
    if file != "-" and not sys.stdin.isatty():
        text = read_stdin()
        if text.strip():
            if prompts:
                given = "PROMPT arguments" if arguments else f"--file {file}"
                raise InvalidInputError(
                    f"both {given} and text on stdin were given: use one, or pass stdin's "
                    "lines as more prompts with --file -"
                )
            prompts.append(text.rstrip("\n"))
    if not prompts:
        raise InvalidInputError("no prompt given: pass PROMPT, --file F, or pipe text on stdin")
    return prompts
