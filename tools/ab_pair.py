"""nanoqwen from two trees through one pair.py workload, alternating round by round, in one
device call: the before/after measurement of a change.

    python3 tools/ab_pair.py SHAPE WORKLOAD ROUNDS BEFORE_DIR AFTER_DIR

Each directory holds a `nanoqwen/` package (e.g. `git archive REV | tar -x -C DIR`); pair.py
comes from .peer/ (../shared/peer/README.md). Round 0 is a warm-up and is not counted. Prints
every run and, last, an `AB {...}` line with the runs, the medians and after / before."""

import json
import os
import statistics
import subprocess
import sys

shape, work, rounds, before, after = sys.argv[1:4] + [os.path.abspath(p) for p in sys.argv[4:6]]
rounds = int(rounds)
pair = os.path.join(os.getcwd(), ".peer", "pair.py")
site = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and "site" in p]


def env(tree: str) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([*site, tree]))


if not os.path.isdir(f"/tmp/pair-model-{shape}"):
    subprocess.run([sys.executable, pair, "--run", "prepare", "--shape", shape],
                   env=env(os.getcwd()), check=True, stdout=subprocess.DEVNULL)  # fmt: skip
runs = {"before": [], "after": []}
for r in range(rounds + 1):
    for name, tree in (("before", before), ("after", after)):
        p = subprocess.run(
            [sys.executable, pair, "--run", "nanoqwen", "--shape", shape, "--workload", work],
            env=env(tree), capture_output=True, text=True, cwd=tree,
        )  # fmt: skip
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            sys.exit(f"{name} failed: {p.stderr[-3000:]}")
        result = json.loads(line[0][len("RESULT ") :])
        if r:
            runs[name].append(result["tok_s"])
        note = " (warm-up)" if r == 0 else ""
        print(
            f"{shape} {work} round {r}{note} {name:6s} {result['tok_s']:>10,.1f} tok/s", flush=True
        )
median = {k: statistics.median(v) for k, v in runs.items()}
ratio = round(median["after"] / median["before"], 4)
print("AB " + json.dumps({"shape": shape, "workload": work, "runs": runs, "median": median,
                          "after_over_before": ratio}), flush=True)  # fmt: skip
