"""How a user starts and interrupts a tensor-parallel engine: torchrun, and Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from nanoqwen import LLM, SamplingParams
from tests.parallel.test_tp_failure import running

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
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
        from nanoqwen import LLM, SamplingParams
        if __name__ == "__main__":
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
