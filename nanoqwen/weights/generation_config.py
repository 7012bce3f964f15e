"""Sampling defaults from a checkpoint's generation_config.json, read as transformers and vLLM
read them, with Qwen2.5-Instruct's values where the file names none."""

from __future__ import annotations

import json
from pathlib import Path

# Qwen2.5-Instruct's generation_config.json.
QWEN_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_dir: Path | None) -> dict[str, float | int]:
    """The sampling fields the checkpoint's generation_config.json sets, over QWEN_DEFAULTS."""
    found: dict = {}
    path = model_dir / "generation_config.json" if model_dir is not None else None
    if path is not None and path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object")
        for name in FIELDS:
            value = data.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                found[name] = int(value) if name == "top_k" else float(value)
    return QWEN_DEFAULTS | found
