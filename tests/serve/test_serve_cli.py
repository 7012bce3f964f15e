"""`nanoqwen serve` as a command: its flags, one-line errors, and a clean shutdown."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import httpx
import pytest

from .serve_harness import REPO, Server


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nanoqwen", "serve", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_help_lists_server_and_engine_flags():
    r = serve("--help")
    assert r.returncode == 0 and r.stderr == ""
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--max-waiting",
                 "--max-request-bytes", "--stream-interval", "--random-shape", "--model",
                 "--device", "--num-kv-blocks", "--max-num-seqs", "--max-model-len"):  # fmt: skip
        assert flag in r.stdout, flag
    assert "(default: 8000)" in r.stdout and "(default: 1024)" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model"], "model path /nonexistent/model does not exist"),
        (["--port", "70000"], "--port 70000 is out of range: allowed 0..65535"),
        (["--stream-interval", "0"], "--stream-interval 0 is out of range"),
        (["--max-waiting", "-1"], "--max-waiting -1 is out of range"),
        (["--random-shape", "3T"], "argument --random-shape: invalid choice: '3T'"),
    ],
)
def test_bad_flags_end_with_one_line(args, message):
    r = serve(*args)
    assert r.returncode in (1, 2)
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("nanoqwen: error: ") and message in line, line


def test_engine_load_error_is_one_line(tiny_model):
    """An error while the engine process loads the model reads as `nanoqwen generate`'s."""
    r = serve("--model", str(tiny_model[0]), "--device", "cpu", "--max-model-len", "99999", "-q")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("nanoqwen: error: --max-model-len 99999 is too long: "), line


def test_port_in_use(tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = serve("--model", str(tiny_model[0]), "--port", str(port))
    assert r.returncode == 1
    assert (
        r.stderr.strip()
        == f"nanoqwen: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    )


def test_terminate_shuts_down_cleanly(tiny_model, tmp_path):
    server = Server(["--model", str(tiny_model[0]), "--device", "cpu", "--num-kv-blocks", "32",
                     "--block-size", "16"], tmp_path / "server.log")  # fmt: skip
    body = {"prompt": "Hello", "max_tokens": 3}
    assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
    server.close()
    # uvicorn shuts down gracefully, then re-raises the signal it caught (uvicorn >= 0.29).
    assert server.proc.returncode in (0, -signal.SIGTERM)
    log = server.log()
    assert "Traceback" not in log and "Application shutdown complete" in log
