"""--model resolution: local directories, missing paths, and hub ids (cached or not) with the
hub offline. Never touches the network: HF_HUB_OFFLINE is set and the cache is a tmp dir."""

from __future__ import annotations

import shutil

import pytest
from huggingface_hub import constants

from nanoqwen import LLM
from nanoqwen.weights.hub import ModelNotFoundError, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty HF cache under tmp_path, with the hub offline. huggingface_hub reads its
    environment at import, so its constants are patched as well as the variables."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def one_line_error(model) -> str:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(model)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_local_directory(tiny_model):
    assert resolve_model(tiny_model[0]) == tiny_model[0]
    assert resolve_model(str(tiny_model[0])) == tiny_model[0]


@pytest.mark.parametrize("name", ["missing-dir", "./missing/dir", "a/b/c"])
def test_nonexistent_relative_path_is_named(tmp_path, monkeypatch, offline_cache, name):
    monkeypatch.chdir(tmp_path)
    assert one_line_error(name) == f"model path {name} does not exist"


def test_nonexistent_absolute_path_is_named(tmp_path):
    path = tmp_path / "nowhere" / "model"
    assert one_line_error(str(path)) == f"model path {path} does not exist"
    with pytest.raises(ModelNotFoundError, match=f"model path {path} does not exist"):
        LLM(str(path), progress=False)


def test_a_file_is_not_a_model_directory(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    assert one_line_error(str(path)) == f"model path {path} is not a directory"


def test_directory_without_config(tmp_path):
    assert one_line_error(tmp_path) == f"{tmp_path} is a directory without config.json"


def test_hub_id_not_cached_offline_says_how_to_get_it(offline_cache):
    repo = "nanoqwen-tests/not-a-model"
    message = one_line_error(repo)
    assert message.startswith(f"{repo} is neither a local directory nor in the local Hugging")
    assert "HF_HUB_OFFLINE is set" in message
    assert f"`hf download {repo}`" in message
    assert "pass a local directory" in message


def test_offline_variable_set_after_import_is_honoured(offline_cache, monkeypatch):
    """Only the environment says offline (as when a user sets it in-process after
    huggingface_hub was imported): still no network attempt, same message."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert "HF_HUB_OFFLINE is set" in one_line_error("nanoqwen-tests/not-a-model")


def test_default_model_not_built(tmp_path, monkeypatch):
    from nanoqwen.weights import hub

    monkeypatch.setattr(hub, "default_model_dir", lambda: tmp_path / "Qwen")
    message = one_line_error(None)
    assert message.startswith(f"no --model given and the default model is not built at {tmp_path}")
    assert "python tools/make_qwen_coder.py" in message


def test_invalid_hub_id(offline_cache):
    assert "not a valid hub id" in one_line_error("bad name/with spaces")


def test_cached_hub_id_resolves_offline(offline_cache, tiny_model):
    """A snapshot in the HF cache layout is found without the network, and loads."""
    repo_dir = offline_cache / "models--nanoqwen-tests--tiny"
    snapshot = repo_dir / "snapshots" / COMMIT
    shutil.copytree(tiny_model[0], snapshot)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    assert resolve_model("nanoqwen-tests/tiny") == snapshot
    llm = LLM("nanoqwen-tests/tiny", num_kv_blocks=2, block_size=16, progress=False)
    assert llm.config.vocab_size == 512
