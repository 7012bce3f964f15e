"""A tensor-parallel rank that dies or fails, at any point from its start to a step, makes the
caller raise within seconds, naming the rank and quoting its own last error line; nothing is
left behind: no process, /dev/shm entry, socket or file descriptor. On the CPU (gloo)."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.parallel.group import TensorParallelError
from parallel.test_tp_processes import running

BOUND_S = 30  # generous for a loaded CI machine; each takes 0.1-2 s
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def session_processes(sid: int) -> list[int]:
    """Live (not zombie) processes of session sid: a script's ranks and resource tracker."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def open_fds() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # listdir's own descriptor, closed by now
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return out


# The faults, each injected into the spawned rank only: spawn re-imports this script there
# as it starts the rank (named nanoqwen-tp-rank1), so the patches go in at the top.
FAULTS = {
    "join": "import nanoqwen.runtime.parallel.worker as w\n"
    "w.join_group = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)",
    "load-raises": "import nanoqwen.runtime.builder as b\n"
    "def fail(*a, **k): raise OSError('disk on fire')\n"
    "b.load_weights = fail",
    "load-killed": "import nanoqwen.runtime.builder as b\n"
    "b.load_weights = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)",
    "step-raises": "import nanoqwen.runtime.parallel.worker as w\n"
    "step, calls = w.WorkerRunner._step, []\n"
    "def flaky(self, *a):\n"
    "    calls.append(1)\n"
    "    if len(calls) == 3: raise RuntimeError('simulated rank failure')\n"
    "    return step(self, *a)\n"
    "w.WorkerRunner._step = flaky",
}


def run_script(
    tmp_path: Path, model: Path, fault: str, guarded: bool = True
) -> tuple[str, str, float]:
    """Runs a script that builds a two-rank engine and generates; returns its stdout, its
    stderr and how long LLM() + generate() took before raising. Asserts that the script, its
    ranks and its resource tracker are all gone after it."""
    body = textwrap.dedent(f"""
        from nanoqwen import LLM, SamplingParams
        start = time.monotonic()
        try:
            llm = LLM({str(model)!r}, tensor_parallel_size=2, device="cpu", progress=False)
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=20, ignore_eos=True))
            print("no error")
        except Exception as e:
            print(type(e).__name__, e)
        print("seconds", time.monotonic() - start)
    """)
    if guarded:
        body = 'if __name__ == "__main__":\n' + textwrap.indent(body, "    ")
    prelude = "import multiprocessing, os, signal, time\n"
    if fault in FAULTS:
        prelude += 'if multiprocessing.current_process().name == "nanoqwen-tp-rank1":\n'
        prelude += textwrap.indent(FAULTS[fault], "    ") + "\n"
    script = tmp_path / "main.py"
    script.write_text(prelude + body)
    before = shm()
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,  # its session holds every process it starts
    )
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + BOUND_S
    while session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_processes(proc.pid) == [], "processes outlived the script"
    assert shm() - before == set()
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert lines[-1].startswith("seconds"), out
    return "\n".join(lines[:-1]), err, float(lines[-1].split()[1])


def test_a_script_without_the_main_guard_is_told_the_idiom(tmp_path, tiny_model):
    """It used to hang for ever: the rank died re-importing the script, rank 0 waited for it."""
    out, err, seconds = run_script(tmp_path, tiny_model[0], "none", guarded=False)
    assert seconds < BOUND_S
    idiom = '`if __name__ == "__main__":`'
    assert out.startswith("TensorParallelError tensor-parallel rank 1 (pid ")
    assert "exited with code 1 (the script builds a tensor-parallel LLM when imported" in out
    assert out.endswith(f"{idiom}); the engine did not start")
    # The rank says it in one line, instead of multiprocessing's page-long RuntimeError.
    assert err.count(idiom) == 1 and "bootstrapping phase" not in err


@pytest.mark.parametrize(
    "fault, reason, outcome",
    [
        ("join", "was killed by signal 9", "the engine did not start"),
        ("load-raises", "exited with code 1 (OSError: disk on fire)", "the engine did not start"),
        ("load-killed", "was killed by signal 9", "the engine did not start"),
        (
            "step-raises",
            "exited with code 1 (RuntimeError: simulated rank failure)",
            "the tensor-parallel engine is shut down",
        ),
    ],
)
def test_a_rank_that_dies_or_fails_is_named_with_its_error(
    tmp_path, tiny_model, fault, reason, outcome
):
    out, _, seconds = run_script(tmp_path, tiny_model[0], fault)
    assert seconds < BOUND_S
    assert out.startswith("TensorParallelError tensor-parallel rank 1 (pid ")
    assert f") {reason}; {outcome}" in out


def test_a_rank_killed_mid_generate_leaves_nothing_behind(tiny_model):
    """In this process: generate() raises at once, close() returns, and the descriptors,
    sockets (the rendezvous port), /dev/shm and child processes are as before the engine."""
    path = str(tiny_model[0])
    LLM(path, tensor_parallel_size=2, progress=False).close()  # first-use descriptors
    gc.collect()
    fds, before_shm = open_fds(), shm()
    llm = LLM(path, tensor_parallel_size=2, progress=False)
    pids = llm.runner.workers.pids
    stream = llm.stream([[1, 2, 3]], SamplingParams(max_tokens=2000, ignore_eos=True))
    next(stream)
    os.kill(pids[0], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) was killed by signal 9"):
        for _ in stream:
            pass
    assert time.monotonic() - start < BOUND_S
    assert not any(running(p) for p in pids)
    # The engine stays refused, with the same reason, rather than hanging on a later call.
    with pytest.raises(TensorParallelError, match="killed by signal 9"):
        llm.generate([[4, 5]], SamplingParams(max_tokens=2))
    llm.close()
    del llm, stream
    gc.collect()
    assert multiprocessing.active_children() == []
    assert open_fds() == fds
    assert shm() - before_shm == set()


def test_a_script_read_from_stdin_is_told_to_run_from_a_file(tiny_model):
    """spawn runs the main script again from its file: "<stdin>" is none, and the rank died
    re-reading it before it could say why."""
    code = textwrap.dedent(f"""
        from nanoqwen import LLM
        try:
            LLM({str(tiny_model[0])!r}, tensor_parallel_size=2, device="cpu", progress=False)
        except Exception as e:
            print(type(e).__name__, e)
    """)
    proc = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True,
                          env=ENV, timeout=120)  # fmt: skip
    assert proc.stdout.strip() == (
        "TensorParallelError tensor parallelism starts its ranks with multiprocessing's spawn, "
        "which runs the main script again from its file, and this one has none (<stdin>): run "
        'the script from a file, building the LLM under `if __name__ == "__main__":`'
    ), proc.stderr
