"""The processes of a tensor-parallel engine: started by LLM or by torchrun, stopped by
close(), Ctrl-C or the death of any rank, never left behind and never hanging."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.parallel.group import TensorParallelError, spawn_store

BOUND_S = 30  # generous for a loaded CI machine; it takes well under a second
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def running(pid: int) -> bool:
    """Whether pid is a live process (a zombie waiting for its parent to read it is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_ranks_exit_when_rank_zero_is_killed(tiny_model, tmp_path):
    """rank 0 (the user's process) dies without any chance to clean up: the others notice
    and exit instead of waiting forever for its next step."""
    script = tmp_path / "main.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, signal
        from nanoqwen import LLM
        if __name__ == "__main__":
            llm = LLM({str(tiny_model[0])!r}, tensor_parallel_size=2, progress=False)
            print(*llm.runner.workers.pids, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1
    deadline = time.monotonic() + BOUND_S
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(p) for p in pids)


def test_close_stops_the_ranks(tiny_model):
    llm = LLM(str(tiny_model[0]), tensor_parallel_size=2, progress=False)
    procs = llm.runner.workers.procs
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=3))[0].token_ids
    llm.close()
    assert [p.exitcode for p in procs] == [0]
    with pytest.raises(TensorParallelError, match="closed"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=3))


GREEDY = "SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)"


def reference(path) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return LLM(str(path), progress=False).generate([[1, 2, 3]], params)[0].token_ids


def test_torchrun_ranks_serve_rank_zero(tiny_model, tmp_path):
    """Every rank runs the script; only rank 0 gets past LLM(...)."""
    script = tmp_path / "main.py"
    script.write_text(
        textwrap.dedent(f"""
        import os
        from nanoqwen import LLM, SamplingParams
        llm = LLM({str(tiny_model[0])!r}, tensor_parallel_size=2, progress=False)
        out = llm.generate([[1, 2, 3]], {GREEDY})
        print("rank", os.environ["RANK"], *out[0].token_ids, flush=True)
    """)
    )
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = subprocess.run([*run, str(script)], capture_output=True, text=True, env=ENV, timeout=180)
    assert out.returncode == 0, out.stderr
    lines = [line.split() for line in out.stdout.splitlines() if line.startswith("rank")]
    assert lines == [["rank", "0", *map(str, reference(tiny_model[0]))]]


def test_ctrl_c_interrupts_between_steps_and_the_engine_goes_on(tiny_model, tmp_path):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it: the ranks ignore
    it, rank 0 stops its stream, and the engine then generates as before and exits cleanly."""
    script = tmp_path / "main.py"
    script.write_text(
        textwrap.dedent(f"""
        import signal
        from nanoqwen import LLM, SamplingParams
        if __name__ == "__main__":
            # Ctrl-C's handling as a terminal's foreground job has it: a suite run as a
            # background job starts with SIGINT ignored, which this process would inherit.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            llm = LLM({str(tiny_model[0])!r}, tensor_parallel_size=2, progress=False)
            print("pids", *llm.runner.workers.pids, flush=True)
            long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
            try:
                for i, _ in enumerate(llm.stream([[4, 5, 6]], long)):
                    if i == 0:
                        print("streaming", flush=True)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
            print("after", *llm.generate([[1, 2, 3]], {GREEDY})[0].token_ids, flush=True)
    """)
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()[1:]]
        assert proc.stdout.readline().strip() == "streaming"
        os.killpg(proc.pid, signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert rest.splitlines() == [
        "interrupted",
        " ".join(["after", *map(str, reference(tiny_model[0]))]),
    ]
    assert not any(running(p) for p in pids)


def test_the_spawned_ranks_rendezvous_holds_its_port_from_the_start():
    """Rank 0 listens before it spawns anyone, on a port the OS picked: no other process can
    take that port while the workers start (a free port chosen first and listened on later
    was taken once: EADDRINUSE)."""
    store = spawn_store(2)
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", store.port))
    client = spawn_store(2, store.port)
    client.set("ready", "1")
    assert store.get("ready") == b"1"
