"""Servers shared by the serve tests: the tiny model, plainly and behind a key and limits."""

from __future__ import annotations

import importlib.util

import pytest

# The serve extra and the test extra's clients; without them these tests are not collected
# (the header of the run says so).
MISSING = [
    name
    for name in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx")
    if importlib.util.find_spec(name) is None
]
if MISSING:
    collect_ignore_glob = ["test_*.py"]
else:
    from .serve_harness import Server


def pytest_report_header():
    if MISSING:
        return f"tests/serve not run: {', '.join(MISSING)} missing (pip install -e '.[test,serve]')"


TINY_ENGINE = ["--device", "cpu", "--block-size", "16", "--num-kv-blocks", "256"]
API_KEY = "test-key-123"


@pytest.fixture(scope="session")
def tiny_server(tiny_model, tmp_path_factory):
    """The tiny model, default server settings."""
    server = Server(
        ["--model", str(tiny_model[0]), *TINY_ENGINE],
        tmp_path_factory.mktemp("serve") / "tiny.log",
    )
    yield server
    server.close()


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="session")
def strict_server(tiny_model, tmp_path_factory):
    """The tiny model behind an API key, with a small body limit, two running slots and
    backpressure past one waiting sequence."""
    server = Server(
        [
            "--model", str(tiny_model[0]), *TINY_ENGINE, "--api-key", API_KEY,
            "--served-model-name", "tiny", "--max-request-bytes", "20000",
            "--max-num-seqs", "2", "--max-waiting", "1",
        ],
        tmp_path_factory.mktemp("serve") / "strict.log",
    )  # fmt: skip
    yield server
    server.close()
