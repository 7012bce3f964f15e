"""Triton kernels compiled for the H200 (sm_90) without a GPU (sm90_compile.py): each case
compiles, and spills no registers to local memory, before it costs device time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not PTXAS.exists(), reason="Triton without its CUDA backend")
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    # @triton.jit gives interpreted functions under TRITON_INTERPRET: compile in a process
    # without it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    script = Path(__file__).with_name("sm90_compile.py")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=900, cwd=ROOT)  # fmt: skip
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert results, out.stderr[-3000:]
    return {r["case"]: r for r in results}


def test_every_case_compiles_without_spilling(compiled):
    failed = {case: r["error"] for case, r in compiled.items() if "error" in r}
    assert not failed, failed
    spills = {case: r["LOCAL"] for case, r in compiled.items() if r["LOCAL"]}
    assert not spills, spills
    # The cases the script lists, at least the kernels that run at every decode step.
    assert {"gemv qkv +norm +residual", "gemv gate_up +norm", "sampler prepare"} <= set(compiled)
