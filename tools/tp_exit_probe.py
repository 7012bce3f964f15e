"""Where a tensor-parallel engine's shutdown spends its time, stage by stage, on a
multi-GPU machine. In session 11 every tp=2 engine printed its results and then did not
exit: rank 0 hung in torch's _abort_process_group after its workers had left (session 12).
Run this under `timeout -s ABRT N python3 -X faulthandler` so that a hang prints every
thread's stack (tools/gpu_tp.sh exit does, with and without the custom all-reduce).

    python3 tools/tp_exit_probe.py --shape 0.5B --close explicit|atexit
    python3 tools/tp_exit_probe.py --kill --leave-alone abort|backend|skip

--kill: rank 1 is killed after the first generate; the next must fail with
TensorParallelError, and rank 0 then leaves the group alone, the way --leave-alone says:
abort (the engine's way), backend (abort the NCCL backend only) or skip (leave it to exit).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.parallel import custom_all_reduce, group
from nanoqwen.runtime.parallel.group import TensorParallelError

START = time.monotonic()


def stage(what: str) -> None:
    print(f"[{time.monotonic() - START:7.2f} s] {what}", flush=True)


def abort_backend_only() -> None:
    custom_all_reduce.abort_all()
    dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda")).abort()


LEAVE_ALONE = {"abort": group._leave_alone, "backend": abort_backend_only, "skip": lambda: None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5B")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--close", choices=["explicit", "atexit"], default="explicit")
    ap.add_argument("--kill", action="store_true")
    ap.add_argument("--leave-alone", choices=sorted(LEAVE_ALONE), default="abort")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    chosen = LEAVE_ALONE[args.leave_alone]

    def leave_alone() -> None:
        stage(f"leaving alone ({args.leave_alone})")
        chosen()
        stage("left alone")

    group._leave_alone = leave_alone
    llm = LLM(
        random_shape=args.shape, device=args.device, tensor_parallel_size=args.tp, max_num_seqs=8,
        gpu_memory_utilization=0.3, progress=False,
    )  # fmt: skip
    stage("built (graphs captured)")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    out = llm.generate([[1, 2, 3] * 10], params)
    stage(f"generated {len(out[0].token_ids)} tokens")
    if args.kill:
        os.kill(llm.runner.workers.pids[0], signal.SIGKILL)
        try:
            llm.generate([[1, 2, 3] * 10], params)
            stage("ERROR: generated after rank 1 was killed")
        except TensorParallelError as e:
            stage(f"refused: {e}")
    if args.close == "explicit":
        llm.close()
        stage(f"closed; worker exit codes {[p.exitcode for p in llm.runner.workers.procs]}")
    stage("leaving main (atexit handlers next)")


if __name__ == "__main__":
    main()
