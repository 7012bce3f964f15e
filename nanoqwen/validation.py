"""Checks of type, range and consistency for values crossing nanoqwen's boundaries.

Every check raises InvalidInputError with one line, `name=value problem: allowed ...`. The
HTTP server reuses them: SamplingParams(...) / SamplingParams.from_dict(...) validate a
request's parameters, check_prompt() and check_prompt_length() its prompt."""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nanoqwen.errors import InvalidInputError

Prompt = str | list[int]


def show(value: Any, width: int = 60) -> str:
    """repr(value), cut to width characters so a message stays one short line."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def a_type(value: Any) -> str:
    """'an int', 'a dict', ...: the type of value, for a message."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def invalid(name: str, value: Any, problem: str, allowed: str) -> InvalidInputError:
    return InvalidInputError(f"{name}={show(value)} {problem}: allowed {allowed}", param=name)


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def integer(name: str, value: Any, ok: Callable[[int], bool], allowed: str) -> int:
    """An int (not a bool, not a float, however whole) for which ok holds."""
    if not is_int(value):
        raise invalid(name, value, "is not an integer", allowed)
    value = int(value)
    if not ok(value):
        raise invalid(name, value, "is out of range", allowed)
    return value


def optional_integer(name: str, value: Any, ok: Callable[[int], bool], allowed: str) -> int | None:
    return None if value is None else integer(name, value, ok, f"None or {allowed}")


def number(name: str, value: Any, ok: Callable[[float], bool], allowed: str) -> float:
    """A finite int or float (not a bool) for which ok holds, as a float."""
    if not is_number(value):
        raise invalid(name, value, "is not a number", allowed)
    try:
        as_float = float(value)
    except OverflowError:  # an int past float's range
        as_float = math.inf
    if not math.isfinite(as_float) or not ok(as_float):
        raise invalid(name, value, "is out of range", allowed)
    return as_float


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise invalid(name, value, "is not a bool", "True or False")
    return value


def choice(name: str, value: Any, choices: Sequence[str]) -> str:
    allowed = ", ".join(choices)
    if not isinstance(value, str):
        raise invalid(name, value, "is not a string", allowed)
    if value not in choices:
        raise invalid(name, value, "is unknown", allowed)
    return value


def token_ids(name: str, value: Any, vocab_size: int | None = None) -> list[int]:
    """A list or tuple of token ids: ints in 0..vocab_size - 1 (>= 0 when vocab_size is None)."""
    allowed = "a list of token ids " + (
        f"in 0..{vocab_size - 1}" if vocab_size is not None else ">= 0"
    )
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(
        value, (Sequence, range)
    ):
        raise invalid(name, value, "is not a list", allowed)
    ids = list(value)
    for t in ids:
        if not is_int(t):
            raise invalid(name, value, f"holds {show(t, 20)}, not an integer", allowed)
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise invalid(name, value, f"holds {int(t)}", allowed)
    return [int(t) for t in ids]


# ---- prompts ---------------------------------------------------------------------------------
PROMPT_ALLOWED = "a string or a list of token ids"


def check_prompt(prompt: Any, vocab_size: int | None, name: str = "prompt") -> Prompt:
    """A prompt as LLM.generate takes it: a str, or a list of token ids in the vocabulary."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (bytes, bytearray)):
        raise invalid(name, prompt, "is bytes", f"{PROMPT_ALLOWED} (decode bytes first)")
    if isinstance(prompt, (list, tuple)):
        # Plain ints in range, the usual case, checked at C speed: ~10x faster than the loop
        # below (which runs for anything else and finds what is wrong).
        if (
            set(map(type, prompt)) == {int}
            and min(prompt) >= 0
            and (vocab_size is None or max(prompt) < vocab_size)
        ):
            return list(prompt)
        allowed = "a string or a list of token ids" + (
            f" in 0..{vocab_size - 1}" if vocab_size is not None else ""
        )
        for t in prompt:
            if not is_int(t):
                raise invalid(name, prompt, f"holds {show(t, 20)}, not a token id", allowed)
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise invalid(name, prompt, f"holds the token id {int(t)}", allowed)
        return [int(t) for t in prompt]
    raise invalid(name, prompt, f"is {a_type(prompt)}", PROMPT_ALLOWED)


def encode_prompt(prompt: Any, tokenizer, vocab_size: int | None) -> list[int]:
    """A prompt's token ids (a str through the tokenizer); InvalidInputError for anything but
    a str or token ids, or for a str without a tokenizer."""
    prompt = check_prompt(prompt, vocab_size)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidInputError(
                "prompt is a string but this engine has no tokenizer: allowed token id lists",
                param="prompt",
            )
        return tokenizer.encode(prompt)
    return prompt


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    """A prompt must leave room for at least one new token."""
    if num_tokens == 0:
        raise InvalidInputError("prompt is empty: allowed at least one token", param="prompt")
    if num_tokens >= max_model_len:
        raise InvalidInputError(
            f"prompt has {num_tokens} tokens: allowed at most {max_model_len - 1} "
            f"(max_model_len={max_model_len})",
            param="prompt",
        )


def split_prompts(prompts: Any) -> list[Any]:
    """One prompt (a str or a list of token ids) or a sequence of them -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)):
        raise invalid("prompts", prompts, "is bytes", f"{PROMPT_ALLOWED}, or a list of them")
    if not isinstance(prompts, (list, tuple)):
        raise invalid("prompts", prompts, f"is {a_type(prompts)}", f"{PROMPT_ALLOWED}, or a list")
    if prompts and isinstance(prompts[0], numbers.Number):
        return [prompts]  # one prompt of token ids (check_prompt checks each)
    return list(prompts)


def split_sampling_params(params: Any, num_prompts: int, params_type: type) -> list[Any]:
    """None, one params_type, or one per prompt -> one per prompt."""
    if params is None:
        return [params_type()] * num_prompts
    if isinstance(params, params_type):
        return [params] * num_prompts
    allowed = f"None, a {params_type.__name__} or a list of them (one per prompt)"
    if not isinstance(params, (list, tuple)):
        raise invalid("sampling_params", params, f"is {a_type(params)}", allowed)
    for p in params:
        if not isinstance(p, params_type):
            raise invalid("sampling_params", params, f"holds {a_type(p)}", allowed)
    if len(params) != num_prompts:
        raise InvalidInputError(
            f"sampling_params has {len(params)} entries for {num_prompts} prompts: "
            "allowed one, or one per prompt",
            param="sampling_params",
        )
    return list(params)


# ---- files -----------------------------------------------------------------------------------
def read_text(path: os.PathLike | str, what: str = "") -> str:
    """A UTF-8 text file; InvalidInputError naming it when it cannot be read or decoded."""
    label = f"{what} {path}" if what else str(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise InvalidInputError(f"{label}: no such file") from None
    except IsADirectoryError:
        raise InvalidInputError(f"{label} is a directory: allowed a file") from None
    except OSError as e:
        raise InvalidInputError(f"{label}: cannot read it ({e.strerror or e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInputError(
            f"{label} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None


def read_json_object(path: os.PathLike | str) -> dict[str, Any]:
    """A JSON file holding an object; InvalidInputError naming the file otherwise."""
    return json_object(read_text(path), str(path))


def json_object(text: str, label: str) -> dict[str, Any]:
    """JSON text holding an object; InvalidInputError naming it as label otherwise."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidInputError(
            f"{label} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    if not isinstance(raw, dict):
        raise InvalidInputError(f"{label} holds {a_type(raw)}: allowed a JSON object")
    return raw
