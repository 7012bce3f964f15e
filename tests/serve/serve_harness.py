"""`nanoqwen serve` in a subprocess on a free port, and what the tests read from it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]


class Server:
    """`python -m nanoqwen serve --port 0 ARGS`; the port comes from its first log line."""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 180.0) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("NANOQWEN_DEBUG", None)
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nanoqwen", "serve", "--port", "0", *args],
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.url = self._wait_for_port(timeout)
        self._wait_healthy(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_for_port(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(r"serving .* on (http://[\d.]+:\d+)", self.log())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited ({self.proc.returncode}):\n{self.log()}")
            time.sleep(0.1)
        raise AssertionError(f"the server printed no address in {timeout} s:\n{self.log()}")

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"/health never answered 200:\n{self.log()}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def engine_pid(self) -> int:
        """The engine process: the server's child started by multiprocessing's spawn."""
        (pid,) = [
            pid
            for pid in child_pids(self.proc.pid)
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        return pid

    def metrics(self) -> dict[str, float]:
        """/metrics samples by name, `name{finished_reason=...}` for the labelled counter."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                reason = s.labels.get("finished_reason")
                out[f"{s.name}{{{reason}}}" if reason else s.name] = s.value
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Metrics once nothing runs or waits and every KV block is free; fails otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (
                m["nanoqwen:num_requests_running"] == 0
                and m["nanoqwen:num_requests_waiting"] == 0
                and m["nanoqwen:kv_cache_free_blocks"] == m["nanoqwen:kv_cache_total_blocks"]
            )
            if idle:
                assert m["nanoqwen:kv_cache_usage_perc"] == 0.0
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the server is not idle after {timeout} s: {m}")
            time.sleep(0.05)


def child_pids(parent: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid ...: comm may hold spaces, so split after its ")".
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[1]) == parent:
            out.append(int(stat.parent.name))
    return out


def process_gone(pid: int, timeout: float) -> bool:
    """Whether pid exits (or is a zombie: exited, not yet reaped) within timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def wait_for(server: Server, condition, what: str, timeout: float = 30.0) -> dict[str, float]:
    """The server's metrics once condition(metrics) holds; AssertionError after timeout."""
    start = time.monotonic()
    polls, slowest = 0, 0.0  # a server slow to answer /metrics shows in the failure
    while time.monotonic() < start + timeout:
        asked = time.monotonic()
        m = server.metrics()
        polls, slowest = polls + 1, max(slowest, time.monotonic() - asked)
        if condition(m):
            return m
        time.sleep(0.02)
    raise AssertionError(
        f"{what} did not happen in {timeout} s ({polls} polls of /metrics, the slowest "
        f"{slowest:.2f} s): {server.metrics()}"
    )
