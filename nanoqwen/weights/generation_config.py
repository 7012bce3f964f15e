"""Sampling defaults from a checkpoint's generation_config.json, read as transformers and vLLM
read them, with Qwen2.5-Instruct's values where the file names none."""

from __future__ import annotations

import json
from pathlib import Path

# Qwen2.5-Instruct's generation_config.json.
QWEN_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_dir: Path | None) -> dict[str, float | int]:
    """The sampling fields the checkpoint's generation_config.json sets, over QWEN_DEFAULTS
    (what `nanoqwen generate` uses)."""
    return QWEN_DEFAULTS | (checkpoint_sampling_fields(model_dir) or {})


def request_defaults(model_dir: Path | None) -> dict[str, float | int]:
    """What the server gives a request that leaves a sampling field out, as vLLM does: the
    fields generation_config.json sets (none when it sets none); a checkpoint without the file
    (a GGUF) gets Qwen2.5-Instruct's, as `nanoqwen generate` does."""
    found = checkpoint_sampling_fields(model_dir)
    return dict(QWEN_DEFAULTS) if found is None else found


def checkpoint_sampling_fields(model_dir: Path | None) -> dict[str, float | int] | None:
    """The sampling fields generation_config.json sets; None without the file."""
    path = model_dir / "generation_config.json" if model_dir is not None else None
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    found: dict[str, float | int] = {}
    for name in FIELDS:
        value = data.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            found[name] = int(value) if name == "top_k" else float(value)
    return found
