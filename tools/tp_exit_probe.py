"""Where a tensor-parallel engine's shutdown spends its time, stage by stage, on a
multi-GPU machine. In session 11 two `nanoqwen bench --tensor-parallel-size 2` runs with
the custom all-reduce printed their results and then did not exit within 100 s; run this
under `timeout -s ABRT N python3 -X faulthandler` so that a hang prints every thread's
stack (tools/gpu_tp.sh exit does, with and without the custom all-reduce).

    python3 tools/tp_exit_probe.py --shape 0.5B --close explicit|atexit
"""

from __future__ import annotations

import argparse
import time

from nanoqwen import LLM, SamplingParams

START = time.monotonic()


def stage(what: str) -> None:
    print(f"[{time.monotonic() - START:7.2f} s] {what}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5B")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--close", choices=["explicit", "atexit"], default="explicit")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    llm = LLM(
        random_shape=args.shape, device=args.device, tensor_parallel_size=args.tp, max_num_seqs=8,
        gpu_memory_utilization=0.3, progress=False,
    )  # fmt: skip
    stage("built (graphs captured)")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    out = llm.generate([[1, 2, 3] * 10], params)
    stage(f"generated {len(out[0].token_ids)} tokens")
    if args.close == "explicit":
        llm.close()
        stage("closed")
    stage("leaving main (atexit handlers next)")


if __name__ == "__main__":
    main()
