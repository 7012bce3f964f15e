#!/usr/bin/env bash
# Tensor parallelism on a two-GPU machine (device kind nvidia-h200-x2), in one device call:
# the GPU tests at tp=2, batch-1 decode of 7B at tp=1 and tp=2 (the bar: >= 1.6x), the
# all-reduce cost per step, and 32B at tp=2.
# Usage (device tool, carry .whl as for tools/gpu_check.sh); one part per call keeps each
# under the 10-minute command limit:
#   bash tools/gpu_tp.sh probe | custom | exit | tests | allreduce | batch1 | big   (all: every part)
#   bash tools/gpu_tp.sh ncclenv   (NCCL's small all-reduce under protocol/algorithm settings)
# probe: one graph replay of the custom all-reduce watched from outside (with and without an
# NCCL all-reduce in the same graph, then eager), each run ended after 90 s;
# custom: the custom all-reduce's own GPU tests (run them first: every wait in the kernel
# gives up after NANOQWEN_ALL_REDUCE_TIMEOUT_S, pytest after 9 minutes); allreduce: its cost
# next to NCCL's per shape and over message sizes.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
what=${1:-all}
export NANOQWEN_ALL_REDUCE_TIMEOUT_S=${NANOQWEN_ALL_REDUCE_TIMEOUT_S:-30}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nvidia-smi topo -m | head -4
env | grep -E 'NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS'
bench() {  # bench TP NAME ARGS...: one run, its log and JSON under $OUT
  # SIGABRT on a hang: faulthandler prints every thread's stack (session 11's tp=2 runs
  # printed their results, then did not exit).
  local tp=$1 name=$2; shift 2
  timeout -s ABRT "${BENCH_TIMEOUT_S:-300}" python3 -X faulthandler -m nanoqwen.bench \
    --tensor-parallel-size "$tp" --json "$OUT/$name.json" "$@" \
    2>&1 | grep --line-buffered -v $'\r' | tee "$OUT/$name.log"
}
if [[ $what == probe || $what == all ]]; then
  for run in "graph nccl" "graph nonccl" "eager nccl"; do
    echo "== allreduce_probe $run" | tee -a "$OUT/allreduce_probe.log"
    timeout 90 python3 tools/allreduce_probe.py $run 2>&1 | tee -a "$OUT/allreduce_probe.log"
    pkill -9 -f allreduce_probe.py; sleep 1  # a rank left spinning would hold its GPU
  done
fi
if [[ $what == custom || $what == all ]]; then
  timeout "${CUSTOM_TIMEOUT_S:-540}" python3 -m pytest tests/gpu/test_custom_all_reduce_gpu.py -v -rs -x \
    -p no:cacheprovider 2>&1 | tee "$OUT/custom_all_reduce_tests.log"
fi
if [[ $what == exit || $what == all ]]; then  # a tp=2 engine's shutdown, clean and after a kill
  probe() {  # probe NAME ARGS...
    echo "== $1" | tee -a "$OUT/tp_exit.log"; shift
    timeout -s ABRT 60 python3 -X faulthandler tools/tp_exit_probe.py "$@" 2>&1 \
      | tee -a "$OUT/tp_exit.log"
    echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/tp_exit.log"
    pkill -9 -f tp_exit_probe.py; sleep 1
  }
  NANOQWEN_CUSTOM_ALL_REDUCE=1 probe "custom 1, close atexit" --close atexit
  NANOQWEN_CUSTOM_ALL_REDUCE=1 probe "rank 1 killed, leave alone: abort" --kill --leave-alone abort
fi
if [[ $what == tests || $what == all ]]; then
  # The custom collectives on (CUSTOM=0: the NCCL default); the exit tests set both.
  NANOQWEN_CUSTOM_ALL_REDUCE=${CUSTOM:-1} timeout "${TESTS_TIMEOUT_S:-300}" python3 -m pytest \
    tests/gpu/test_tensor_parallel_gpu.py -v -rs -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_tp_tests.log"
fi
if [[ $what == allreduce || $what == all ]]; then
  # SHAPES and SWEEP (=0: no sweep over sizes) narrow it to fit one call with other parts.
  timeout "${ALLREDUCE_TIMEOUT_S:-540}" python3 tools/allreduce_bench.py --tp 2 \
    --shapes "${SHAPES:-7B,14B,32B,72B}" $([[ ${SWEEP:-1} == 0 ]] || echo --sweep) 2>&1 \
    | tee "$OUT/allreduce.log"
fi
if [[ $what == ncclenv ]]; then
  # NCCL's small-message all-reduce in a graph took ~16 µs (session 5): does forcing its
  # low-latency protocol or one algorithm cut that? (Set before the communicator exists.)
  for env in "" "NCCL_PROTO=LL" "NCCL_PROTO=LL NCCL_ALGO=Ring" "NCCL_PROTO=LL128"; do
    echo "== ${env:-NCCL defaults}" | tee -a "$OUT/allreduce_ncclenv.log"
    env $env timeout 120 python3 tools/allreduce_bench.py --tp 2 --shapes 7B 2>&1 \
      | tee -a "$OUT/allreduce_ncclenv.log"
  done
fi
if [[ $what == batch1 || $what == all ]]; then
  for tp in 1 2; do
    bench "$tp" "7B_batch1_tp$tp" --shape 7B --mode latency --batch-sizes 1 --sampling greedy \
      --max-num-seqs 16
  done
  # tp=2 with the custom all-reduce switched on: what it gains over NCCL
  NANOQWEN_CUSTOM_ALL_REDUCE=1 bench 2 "7B_batch1_tp2_custom" --shape 7B --mode latency \
    --batch-sizes 1 --sampling greedy --max-num-seqs 16
  python3 - "$OUT" <<'PY'
import json, sys
runs = {"tp1": "tp=1", "tp2": "tp=2 (NCCL)", "tp2_custom": "tp=2, custom all-reduce"}
rate = {k: json.load(open(f"{sys.argv[1]}/7B_batch1_{k}.json"))["latency"][0] for k in runs}
for k, row in rate.items():
    print(f"7B batch 1, {runs[k]}: {row['decode_tok_s']:.1f} tok/s, {row['step_ms_p50']:.3f} ms/step")
for k in ("tp2", "tp2_custom"):
    print(f"{runs[k]} / tp=1: {rate[k]['decode_tok_s'] / rate['tp1']['decode_tok_s']:.3f}x (bar: >= 1.6x)")
PY
fi
if [[ $what == big || $what == all ]]; then
  bench 2 "32B_tp2" --shape 32B --mode all --batch-sizes 1,64 --sampling greedy
fi
