"""The serving benchmark against the tiny model's server, and its offline counterpart."""

from __future__ import annotations

import json
import subprocess
import sys

from nanoqwen.bench.serve import make_workload

REPO_ARGS = ["--prompt-len", "5:12", "--output-len", "3:9", "--max-token-id", "300", "--seed", "4"]


def bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "nanoqwen.bench.serve", *REPO_ARGS, "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "serving benchmark" in proc.stdout
    return json.loads(out.read_text())


def check_latencies(result: dict, names: tuple[str, ...]) -> None:
    for name in names:
        p50, p90, p99 = (result[f"{name}_ms_p{q}"] for q in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99, name


def test_burst_and_poisson_against_the_server(tiny_server, tmp_path):
    work = make_workload(12, (5, 12), (3, 9), 300, seed=4)
    # The burst from two client processes (each takes every other request).
    for rate, clients in (("inf", "2"), ("40", "1")):
        result = bench(tmp_path, "--base-url", tiny_server.url, "--num-requests", "12",
                       "--request-rate", rate, "--client-processes", clients)  # fmt: skip
        assert (result["completed"], result["failed"]) == (12, 0)
        assert result["output_tokens"] == sum(work.output_lens)
        assert result["prompt_tokens"] == sum(map(len, work.prompts))
        assert result["output_tok_s"] == result["output_tokens"] / result["duration_s"]
        check_latencies(result, ("ttft", "tpot", "itl", "e2e"))
    tiny_server.wait_idle()


def test_offline_counterpart_and_comparison(tiny_server, tiny_model, tmp_path):
    engine = ["--model", str(tiny_model[0]), "--device", "cpu", "-q"]
    engine += ["--block-size", "16", "--num-kv-blocks", "64"]
    offline = bench(tmp_path, "--offline", *engine, "--num-requests", "6")
    work = make_workload(6, (5, 12), (3, 9), 300, seed=4)
    assert offline["mode"] == "offline" and offline["output_tokens"] == sum(work.output_lens)
    (tmp_path / "offline.json").write_text(json.dumps(offline))
    online = bench(tmp_path, "--base-url", tiny_server.url, "--num-requests", "6",
                   "--compare", str(tmp_path / "offline.json"))  # fmt: skip
    assert online["offline_output_tok_s"] == offline["output_tok_s"]
    assert online["x_offline"] == online["output_tok_s"] / offline["output_tok_s"]


def test_failed_requests_are_counted(tmp_path):
    args = ["--base-url", "http://127.0.0.1:9", "--model-name", "m", "--num-requests", "3"]
    proc = subprocess.run(
        [sys.executable, "-m", "nanoqwen.bench.serve", *args, *REPO_ARGS,
         "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    result = json.loads((tmp_path / "r.json").read_text())
    assert proc.returncode == 1 and (result["completed"], result["failed"]) == (0, 3)
    assert "ConnectError" in result["errors"][0]
