"""The engine in its own process, as a user sees it: its death fails the requests in flight
and /health says so; stopping or killing the server leaves no engine process behind; a
client that stops reading holds up nobody else."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import h11
import httpx
import pytest
from openai import AsyncOpenAI

from nanoqwen import LLM, SamplingParams

from .conftest import TINY_ENGINE
from .serve_harness import Server, child_pids, process_gone, wait_for

LONG = {"prompt": "def fib(n):", "max_tokens": 2000, "ignore_eos": True}
BOUND_S = 20  # the server exits within a second of its engine


def kill_mid_stream(url: str, pid: int) -> tuple[list[str], float]:
    """Starts a long stream, kills pid (SIGKILL) once its first event is in, and reads the
    stream to its end: (its data lines, when the kill was sent)."""
    with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        return [line for line in lines if line.startswith("data: ")], killed


def engine_death_stops_the_server(
    engine_args: list[str], log: Path, prompt: str | list[int], max_tokens: int = 2000
) -> None:
    """Killed mid-stream: the stream ends with an error event, the waiting request gets a
    500, and the server exits 1 within seconds for its supervisor to restart it (/health's
    503 in between: test_serve_engine_failure.py)."""
    server = Server(engine_args, log, timeout=600)
    url = f"{server.url}/v1/completions"
    # Token ids in every event: without a tokenizer (random weights) the text is empty, and a
    # stream sends nothing a client can see until it ends.
    long = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    try:
        whole: list[httpx.Response] = []
        # A whole response arrives only when it ends: no read timeout of httpx's 5 s default.
        post = lambda: whole.append(httpx.post(url, json=long, timeout=60))  # noqa: E731
        waiter = threading.Thread(target=post)
        with httpx.stream("POST", url, json={**long, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            # Read as a client does meanwhile: a stream nobody reads backs up in the server.
            events: list[str] = []
            reader = threading.Thread(
                target=lambda: events.extend(x for x in lines if x.startswith("data: "))
            )
            reader.start()
            waiter.start()
            wait_for(server, lambda m: m["nanoqwen:num_requests_running"] == 2, "two running")
            engine = server.engine_pid()
            os.kill(engine, signal.SIGKILL)
            killed = time.monotonic()
            reader.join(BOUND_S)
        waiter.join(30)
        server.proc.wait(timeout=BOUND_S)
        took = time.monotonic() - killed
    finally:
        server.close()
    why = "the engine process exited (exit code -9)"
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["message"] == f"the engine failed: {why}"
    assert whole[0].status_code == 500
    assert whole[0].json()["error"]["message"] == f"the engine failed: {why}"
    assert took < BOUND_S
    assert server.proc.returncode == 1
    assert f"nanoqwen: error: {why}" in server.log()
    assert "Traceback" not in server.log()
    assert process_gone(engine, timeout=5)


def test_engine_process_death_fails_requests_in_flight_and_stops_the_server(tiny_model, tmp_path):
    engine = ["--model", str(tiny_model[0]), *TINY_ENGINE]
    engine_death_stops_the_server(engine, tmp_path / "server.log", "def fib(n):")


def test_with_restart_engine_a_new_engine_process_takes_over(tiny_model, tmp_path):
    """--restart-engine: the request in flight fails as without it, /health answers 503
    while a new engine process loads, then the same server serves again."""
    engine_args = ["--model", str(tiny_model[0]), *TINY_ENGINE, "--restart-engine"]
    server = Server(engine_args, tmp_path / "server.log")
    url = f"{server.url}/v1/completions"
    try:
        first = server.engine_pid()
        events, killed = kill_mid_stream(url, first)
        why = "the engine process exited (exit code -9)"
        assert json.loads(events[-2][6:])["error"]["message"] == f"the engine failed: {why}"
        # A new process takes seconds to import torch and load: the old one's death shows.
        assert httpx.get(f"{server.url}/health").status_code == 503
        while httpx.get(f"{server.url}/health").status_code != 200:
            assert time.monotonic() - killed < 60, "no new engine process in 60 s"
            time.sleep(0.1)
        second = server.engine_pid()
        assert second != first and process_gone(first, timeout=5)
        body = {"prompt": "def fib(n):", "max_tokens": 4, "ignore_eos": True}
        answer = httpx.post(url, json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        assert server.proc.poll() is None
    finally:
        server.close()
    assert process_gone(second, timeout=5)
    assert "Traceback" not in server.log()


def test_a_new_engine_process_that_cannot_load_stops_the_server(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model[0], model)
    server = Server(
        ["--model", str(model), *TINY_ENGINE, "--restart-engine"], tmp_path / "server.log"
    )
    try:
        engine = server.engine_pid()
        for weights in model.glob("*.safetensors"):
            weights.unlink()  # the new process finds no weights
        os.kill(engine, signal.SIGKILL)
        server.proc.wait(timeout=60)
    finally:
        server.close()
    assert server.proc.returncode == 1
    why = "the engine process exited (exit code -9); restart: "
    assert f"nanoqwen: error: {why}" in server.log()
    assert "Traceback" not in server.log()


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_stopping_or_killing_the_server_ends_the_engine_process(tiny_model, tmp_path, how):
    server = Server(["--model", str(tiny_model[0]), *TINY_ENGINE], tmp_path / "server.log")
    engine = server.engine_pid()
    url = f"{server.url}/v1/completions"
    with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as r:
        assert next(r.iter_lines()).startswith("data: {")  # the engine is busy with it
        if how == "SIGTERM":
            server.close()
            assert server.proc.returncode in (0, -signal.SIGTERM)
        else:  # no clean-up at all: the engine sees the pipe close
            server.proc.kill()
            server.close()
    assert process_gone(engine, timeout=20), f"the engine process {engine} outlived the server"


# ---- a client that stops reading ---------------------------------------------------------------
def unsent_bytes(server_port: int, client_port: int) -> int:
    """The server socket's send queue towards client_port (/proc/net/tcp's tx_queue)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1].split(":")[1], fields[2].split(":")[1]
        if (int(local, 16), int(remote, 16)) == (server_port, client_port):
            return int(fields[4].split(":")[0], 16)
    raise AssertionError(f"no connection {server_port} -> {client_port}")


def read_response(sock: socket.socket) -> bytes:
    """The whole body of the HTTP response on sock (h11 undoes the chunked encoding)."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("Host", "x")]))  # state only
    conn.send(h11.EndOfMessage())
    body = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(65536))
        elif isinstance(event, h11.Response):
            assert event.status_code == 200
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return body


def test_stalled_client_does_not_hold_up_the_engine_or_other_streams(tiny_server, tiny_model):
    model = str(tiny_model[0])
    llm = LLM(model, block_size=16, num_kv_blocks=256, progress=False)
    others = [f"Hello world {i}" for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    want_others = llm.generate(others, greedy)
    want_stalled = llm.generate("def fib(n):", SamplingParams(temperature=0, max_tokens=300))[0]
    before = tiny_server.wait_idle()

    # 4 x 300 tokens streamed with their ids: ~250 kB of events, far more than the kernel's
    # and uvicorn's buffers hold for a client that reads nothing.
    body = json.dumps({"model": model, "prompt": "def fib(n):", "max_tokens": 300, "n": 4,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "return_token_ids": True}).encode()  # fmt: skip
    host, port = tiny_server.url.removeprefix("http://").split(":")
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
    stalled.connect((host, int(port)))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    stalled.sendall(head.encode() + body)
    try:

        async def one(client: AsyncOpenAI, i: int) -> str:
            stream = await client.completions.create(
                model=model, prompt=others[i], temperature=0, max_tokens=24, stream=True
            )
            return "".join([chunk.choices[0].text async for chunk in stream])

        async def everyone() -> list[str]:
            async with AsyncOpenAI(
                base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0
            ) as client:
                return await asyncio.gather(*(one(client, i) for i in range(8)))

        assert asyncio.run(everyone()) == [w.text for w in want_others]
        # The engine made all of the stalled request too, without waiting for its reader.
        after = tiny_server.wait_idle()
        counter = "nanoqwen:generation_tokens_total"
        made = after[counter] - before[counter]
        assert made == 4 * 300 + sum(len(w.token_ids) for w in want_others)
        assert unsent_bytes(int(port), stalled.getsockname()[1]) > 0  # it is stalled indeed
        events = read_response(stalled).decode().split("\n\n")
    finally:
        stalled.close()
    assert events[-2:] == ["data: [DONE]", ""]
    tokens: dict[int, list[int]] = {i: [] for i in range(4)}
    for event in events[:-2]:
        choice = json.loads(event.removeprefix("data: "))["choices"][0]
        tokens[choice["index"]] += choice["token_ids"]
    assert tokens == {i: want_stalled.token_ids for i in range(4)}
    assert "Traceback" not in tiny_server.log()


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        children = child_pids(todo.pop())
        found += children
        todo += children
    return found


def test_a_dead_tensor_parallel_rank_stops_the_server(tiny_model, tmp_path):
    """The engine process's rank 1 killed mid-stream: the stream ends with an error naming
    it, the engine process exits 1 (no later step could run), and so does the server;
    no process of it is left."""
    args = ["--model", str(tiny_model[0]), *TINY_ENGINE, "--tensor-parallel-size", "2"]
    server = Server(args, tmp_path / "server.log")
    url = f"{server.url}/v1/completions"
    try:
        everything = descendants(server.proc.pid)
        (rank,) = [pid for pid in child_pids(server.engine_pid())
                   if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]  # fmt: skip
        events, killed = kill_mid_stream(url, rank)
        server.proc.wait(timeout=BOUND_S)
        took = time.monotonic() - killed
    finally:
        server.close()
    assert events[-1] == "data: [DONE]"
    message = json.loads(events[-2][6:])["error"]["message"]
    assert f"tensor-parallel rank 1 (pid {rank}) was killed by signal 9" in message
    assert took < BOUND_S
    assert server.proc.returncode == 1
    assert "nanoqwen: error: the engine process exited (exit code 1)" in server.log()
    assert all(process_gone(pid, timeout=5) for pid in everything)
