"""An engine stays inside gpu_memory_utilization once its CUDA graphs are captured and while
it serves: at 0.5B with 256 sequences, a logits output per graph would be ~8 GiB past what the
KV cache is sized around (runtime/graph_logits.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# In a process of its own: memory that earlier tests' engines left cached would count.
SCRIPT = """
import json, random
import torch
from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.config import EngineConfig

llm = LLM(config=EngineConfig(random_shape="0.5B", device="cuda", dtype="bfloat16",
                              max_num_seqs=256, gpu_memory_utilization=0.3, progress=False))
runner = llm.runner
shared = runner.graphs.logits.untyped_storage().data_ptr()
outputs = [g[1] for g in runner.graphs.graphs.values()]
outputs += [g[1] for g in runner.prefill_graphs.graphs.values()]
after_capture = torch.cuda.max_memory_reserved()
rng = random.Random(0)
prompts = [[rng.randrange(10000) for _ in range(rng.randrange(100, 1024))] for _ in range(256)]
params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randrange(4, 64))
          for _ in prompts]
out = llm.generate(prompts, params, use_tqdm=False)
print(json.dumps({
    "total": torch.cuda.mem_get_info()[1],
    "after_capture": after_capture,
    "peak": torch.cuda.max_memory_reserved(),
    "graphs": len(outputs),
    "shared": sum(t.untyped_storage().data_ptr() == shared for t in outputs),
    "finished": sum(len(o.token_ids) == p.max_tokens for o, p in zip(out, params)),
}))
"""


def test_graphs_and_serving_stay_inside_gpu_memory_utilization():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["graphs"] > 100
    assert r["shared"] == r["graphs"]  # every graph writes its logits into one buffer
    assert r["finished"] == 256
    budget = 0.3 * r["total"]
    assert r["after_capture"] <= budget, (r["after_capture"] / 2**30, budget / 2**30)
    assert r["peak"] <= budget, (r["peak"] / 2**30, budget / 2**30)
