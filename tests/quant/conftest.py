"""Fixtures of the quantization tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def gguf_path(real_model_dir):
    path = real_model_dir.parent / ".cache" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing: run `python tools/make_qwen_coder.py`")
    return path
