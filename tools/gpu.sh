#!/usr/bin/env bash
# The GPU checks, one mode per device call (device tool, carry .whl: the flash-attn wheel).
# Usage: bash tools/gpu.sh MODE [ARGS...]
#   check [tests|tests-from N|bench|all|kernels|profile|prefill|workload] [ARGS...]
#       the GPU tests, then the 0.5B and 7B benchmarks (default all); tests-from N runs the one-GPU
#       test files from the Nth on, file by file with a log and a summary line each, so that a call
#       cut off by the command limit leaves the files it finished and the next call starts at the
#       file it was in (they take more than one call); kernels, profile and prefill run
#       tools/kernel_bench.py, tools/profile_decode.py and tools/prefill_bench.py with ARGS (prefill
#       kernels [--sweep] | prefill engine --shape 7B); workload [SHAPE] [WORKLOAD] runs
#       tools/profile_workload.py for nanoqwen and nano-vllm (carry .peer too), 7B throughput by
#       default.
#   kv-cache [tests|bench|all] [0.5B|7B]
#       the swap / host-tier tests, then swap vs recompute under a pool a quarter of the batch
#       needs, host tier on vs off for prefixes that fit the host pool but not the GPU pool,
#       and the shared-prefix workload with prefix caching on vs off.
#   tp [custom|tests|allreduce|ncclenv|batch1|big|all]
#       tensor parallelism on a two-GPU machine (device kind nvidia-h200-x2): the custom
#       all-reduce's GPU tests, the GPU tests at tp=2, the all-reduce cost per shape, NCCL's
#       small all-reduce under protocol/algorithm settings, batch-1 decode of 7B at tp=1 and
#       tp=2 (the bar: >= 1.6x), 32B at tp=2. One part per call keeps each under the 10-minute
#       command limit; all runs every part but ncclenv.
#   serve-bench [SHAPE ...]
#       the serving benchmark per shape of random weights (carry .serve-wheels too): see
#       serve_bench below.
#   speculation [SHAPE ...]
#       tools/spec_step_bench.py (a verify step of k = 4 against a decode step, batch 1) and
#       batch-1 greedy decoding plain vs prompt lookup per shape, then the GPU tests of
#       speculation, mixed steps and the float8 KV cache.
#   long-context [131k|streams|decode ...]
#       nanoqwen bench --mode long at 7B with YaRN (carry .peer for the tokenizer): a
#       131,072-token prompt; 64 streams while a 32K prompt arrives (BUDGET tokens a step,
#       default 2048), with the bf16 and the fp8 KV cache (KV_DTYPES); decode at 64 sequences x 8K
#       context (FP8_SHAPE, default 7B), bf16 and fp8 KV cache, for each tree in TREES (as
#       batch1 takes them) and then the checkout. Default: all three.
#   profile-steps
#       tools/profile_step.py's kernel profiles: a 7B mixed step, a 0.5B verify step, 0.5B
#       decode at 64 x 8K with the bf16 and the fp8 KV cache; then tools/kernel_bench.py
#       --fp8 (the decode kernel's tiles and splits over both caches).
#   batch1 [DIR ...]
#       batch-1 decode: the latency bench at 0.5B, batch 1 and 64, greedy, first for each
#       DIR's nanoqwen/ (e.g. `git archive REV nanoqwen | tar -x -C .exp/REV`, carried: an
#       A/B in one call), then for the checkout; tools/profile_decode.py's critical path at
#       batch 1; tools/gemv_chain_bench.py --sweep; tools/pdl_chain_bench.py (a kernel
#       boundary's cost).
#   int4 [DIR ...]
#       int4 weights at batch 1: tools/quant_kernel_bench.py's stack and tensor-core GEMV
#       sweep at 7B (groups of 128 with offsets), then the 7B latency bench at batch 1 with
#       int4 weights for each DIR's nanoqwen/ (as batch1 takes them) and the checkout, and
#       with bf16 weights for the checkout: the int4 / bf16 ratio of one call.
#   stream [DIR ...]
#       7B bf16 at batch 1 on the streamed GEMV (kernels/triton/stream_gemv.py):
#       tools/stream_gemv_bench.py (cuBLAS against the kernel's launch parameters; 7B's
#       projections and both shapes' lm_head), then the
#       7B latency bench at batch 1 for each DIR's nanoqwen/ and the checkout, then
#       tools/profile_decode.py's critical path of a 7B batch-1 step.
#   ab [DIR ...]
#       the batch-1 goals' figures, per tree (as batch1 takes them, then the checkout), in one
#       call: 0.5B batch 1 and 64 greedy / the CLI's sampling / top-p alone, 7B batch 1 bf16
#       and int4 (group 128); AB_PARTS picks some of "small 7b int4 mid" (default the first
#       three; mid: 0.5B batch 8 and 32 greedy, which must not get slower). AB_ROUNDS rounds
#       (default 1), the trees taking turns in each; with DEADLINE (seconds from the start), a
#       run that would likely not finish by then is skipped and said so, so that a call cut
#       short still returns whole rounds. The end prints each tree's step p50 lines.
#   fp8-kernel [DIR ...]
#       the decode kernel alone at 64 x 8K as launched, bf16 and float8 cache, 0.5B and 7B
#       (tools/kernel_bench.py --fp8-default), for each DIR's nanoqwen/ (as batch1 takes
#       them) and then the checkout, in one call.
#   sampling [DIR ...]
#       the sampler against greedy decoding: the latency bench at 0.5B, batch 1 and 64,
#       greedy / the CLI's sampling / top-p alone, first for each DIR's nanoqwen/ (as batch1
#       takes them), then for the checkout; tools/profile_sampler.py's kernels at batch 1
#       and 64 for each tree the same way.
#   goals
#       the open issues' figures on one GPU, the most wanted first, each skipped when DEADLINE
#       (seconds from the start, default 570) leaves too little: 7B decode at 64 x 8K
#       context with the bf16 then the float8 KV cache and the float8 tests; 7B batch 1 bf16
#       and int4; 0.5B batch 1 and 64 greedy / the CLI's sampling / top-p alone; with
#       GOALS_PARTS="pair" (carry .peer), pair.py's batch1 workload at 0.5B and at 7B.
#       Prints the float8 / bf16 and int4 / bf16 ratios of the call and the GPU's name.
# FLASH_ATTN=0 skips the wheel: everything then runs as on a GPU without flash-attn.
set -uo pipefail

usage() {
  echo "usage: bash tools/gpu.sh check|kv-cache|tp|serve-bench|speculation|long-context|profile-steps|batch1|ab|sampling|int4|stream|fp8-kernel|goals [ARGS...]" >&2
  exit 2
}

# Unbuffered output, $OUT, and the flash-attn wheel from .whl installed onto PYTHONPATH.
# gpu_env: the wheel must install; gpu_env optional: installed when .whl holds one.
gpu_env() {
  export PYTHONUNBUFFERED=1
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
  if [[ ${FLASH_ATTN:-1} != 0 ]]; then
    if [[ ${1:-} != optional ]] || compgen -G ".whl/*.whl" > /dev/null; then
      python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl \
        2>/dev/null || exit 1
    fi
  fi
  export PYTHONPATH=/tmp/site:$PWD
}

# 7B batch-1 decode, as the stream and int4 modes time it.
LATENCY_7B=(python3 -m nanoqwen.bench --shape 7B --mode latency --batch-sizes 1 --sampling greedy
            --max-num-seqs 4 --num-kv-blocks 64 --new-tokens 128)
# 0.5B batch 1 and 64 under the sampling presets the batch-1 goal names.
PRESETS_05B=(python3 -m nanoqwen.bench --shape 0.5B --mode latency --batch-sizes 1,64
             --sampling greedy,cli,t1-p0.9 --max-num-seqs 64)
# Decode at 64 sequences x 8K context, the float8 KV cache's goal (shape and cache added).
DECODE_64X8K=(--mode latency --batch-sizes 64 --prompt-len 8192 --new-tokens 64 --max-num-seqs 64)

# in_tree DIR LOG CMD...: CMD run in DIR with DIR's nanoqwen/ first on the path (an A/B
# tree, or . for the checkout), progress lines dropped, shown and added to
# $OUT/LOG_<DIR's name>.log (LOG_checkout.log for the checkout).
in_tree() {
  local dir=$1 log=$2 name; shift 2
  name=$(basename "$dir"); [[ $dir == . ]] && name=checkout
  (cd "$dir" && PYTHONPATH=/tmp/site:$PWD "$@" 2>&1 | grep -v $'\r' \
    | tee -a "$OUT/${log}_${name}.log")
}

# in_trees LOG DIR... -- CMD...: in_tree for each DIR, then for the checkout.
in_trees() {
  local log=$1 dirs=() dir; shift
  while [[ $1 != -- ]]; do dirs+=("$1"); shift; done
  shift
  for dir in "${dirs[@]}" .; do
    in_tree "$dir" "$log" "$@"
  done
}

check() {
  gpu_env
  local what=${1:-all}; shift || true
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  python3 -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>/dev/null || echo "flash_attn: not installed"
  if [[ $what == tests || $what == all ]]; then
    python3 -m pytest tests/gpu -q -rs -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
  fi
  if [[ $what == tests-from ]]; then
    local files=() i name
    mapfile -t files < <(ls tests/gpu/test_*.py tests/kernels/triton/test_*_gpu.py \
                           | grep -v -e tensor_parallel -e custom_all_reduce)
    for ((i = ${1:-1} - 1; i < ${#files[@]}; i++)); do
      name=$(basename "${files[i]}" .py)
      echo "[$((i + 1))/${#files[@]}] ${files[i]}: $(date +%T)"
      python3 -m pytest "${files[i]}" -q -rfE -p no:cacheprovider > "$OUT/tests_$name.log" 2>&1
      tail -1 "$OUT/tests_$name.log"
      grep -E "^(FAILED|ERROR)" "$OUT/tests_$name.log" | head -20
    done
  fi
  if [[ $what == bench || $what == all ]]; then
    for shape in 0.5B 7B; do
      python3 -m nanoqwen.bench --shape "$shape" --json "$OUT/bench_${shape}.json" "$@" 2>&1 \
        | grep -v '\r' | tee "$OUT/bench_${shape}.log"
    done
  fi
  if [[ $what == kernels ]]; then
    python3 tools/kernel_bench.py "$@" 2>&1 | tee "$OUT/kernels.log"
  fi
  if [[ $what == profile ]]; then
    for shape in 0.5B 7B; do
      python3 tools/profile_decode.py --shape "$shape" --kernels "$@" 2>&1 | tee "$OUT/profile_${shape}.log"
      python3 tools/profile_decode.py --shape "$shape" --max-model-len 4096 "$@" 2>&1 | tee -a "$OUT/profile_${shape}.log"
    done
  fi
  if [[ $what == prefill ]]; then  # prefill kernels [--sweep] | prefill engine --shape 7B
    python3 tools/prefill_bench.py "$@" --json "$OUT/prefill_$1.json" 2>&1 | grep -v '\r' \
      | tee -a "$OUT/prefill_$1.log"
  fi
  if [[ $what == workload ]]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .peer/*.whl
    for engine in nanoqwen nano-vllm; do
      python3 tools/profile_workload.py --engine "$engine" --shape "${1:-7B}" \
        --workload "${2:-throughput}" 2>&1 | grep --line-buffered -v $'\r' \
        | tee "$OUT/profile_workload_$engine.log"
    done
  fi
}

batch1() {
  gpu_env optional
  local bench=(python3 -m nanoqwen.bench --shape 0.5B --mode latency --batch-sizes 1,64
               --sampling greedy --max-num-seqs 64)
  in_trees batch1 "$@" -- "${bench[@]}"
  python3 tools/profile_decode.py --shape 0.5B --batch-sizes 1 --kernels 2>&1 \
    | tee "$OUT/batch1_profile.log"
  python3 tools/gemv_chain_bench.py --sweep 2>&1 | tee "$OUT/gemv_chain.log"
  python3 tools/pdl_chain_bench.py 2>&1 | tee "$OUT/pdl_chain.log"
}

# within SECONDS CMD...: CMD, unless DEADLINE (seconds from the script's start) leaves less
# than SECONDS for it.
within() {
  local need=$1 left; shift
  left=$(( ${DEADLINE:-1000000} - SECONDS ))
  if (( left < need )); then
    echo "skipped, ${left} s left of DEADLINE (needs ~${need} s): $*"
    return
  fi
  "$@"
}

ab() {
  gpu_env optional
  local mid=(python3 -m nanoqwen.bench --shape 0.5B --mode latency --batch-sizes 8,32
             --sampling greedy --max-num-seqs 32)
  local dir round log parts=" ${AB_PARTS:-small 7b int4} "
  # The first round compiles each tree's kernels: about a minute a run, later rounds ~15 s.
  for ((round = 1; round <= ${AB_ROUNDS:-1}; round++)); do
    local need=$(( round == 1 ? 60 : 20 ))
    for dir in "$@" .; do
      [[ $parts == *" small "* ]] && within $need in_tree "$dir" ab_small "${PRESETS_05B[@]}"
      [[ $parts == *" 7b "* ]] && within $need in_tree "$dir" ab_7b "${LATENCY_7B[@]}"
      [[ $parts == *" int4 "* ]] && within $need in_tree "$dir" ab_int4 \
        "${LATENCY_7B[@]}" --quantization int4
      [[ $parts == *" mid "* ]] && within $need in_tree "$dir" ab_mid "${mid[@]}"
    done
  done
  for log in "$OUT"/ab_*.log; do  # the result rows (batch | sampling | ...), per part and tree
    [[ -e $log ]] && grep -H -E "^[0-9]+ \\|" "$log"
  done
}
sampling() {
  gpu_env optional
  local profile=(python3 "$PWD/tools/profile_sampler.py" --batch-sizes 1,64
                 --presets greedy,cli,t1-p0.9 --kernels)
  in_trees sampling "$@" -- "${PRESETS_05B[@]}"
  in_trees sampler_kernels "$@" -- "${profile[@]}"
}

kv_cache() {
  gpu_env optional
  local what=${1:-all} shape=${2:-0.5B}
  kv_bench() {  # name, then bench flags
    local name=$1; shift
    python3 -m nanoqwen.bench --shape "$shape" --mode throughput \
      --json "$OUT/kv_${shape}_${name}.json" "$@" 2>&1 | grep -v $'\r' | tee "$OUT/kv_${shape}_${name}.log"
  }
  if [[ $what == tests || $what == all ]]; then
    python3 -m pytest tests/gpu/test_swap_gpu.py tests/gpu/test_prefix_cache_gpu.py -q -rs -s -p no:cacheprovider 2>&1 | tee "$OUT/kv_tests.log"
  fi
  if [[ $what == bench || $what == all ]]; then
    # 1. 256 requests of ~1,124 tokens (prompt and output uniform in [100, 1024]) need ~288k
    #    tokens at full batch; 280 blocks of 256 hold 72k, a quarter. Swap vs recompute, with
    #    prefix caching off (recompute then really recomputes) and on (the default).
    for mode in swap recompute; do
      kv_bench "quarter_${mode}_nocache" --num-kv-blocks 280 --preemption-mode "$mode" --swap-space 16 --no-prefix-caching
      kv_bench "quarter_${mode}" --num-kv-blocks 280 --preemption-mode "$mode" --swap-space 16
    done
    # 2. 64 prefixes of 2,048 tokens (131k tokens) asked round-robin: 256 GPU blocks (65k
    #    tokens) cannot keep them, 16 GiB of host memory can. Host tier on vs off.
    for swap in 16 0; do
      kv_bench "host_tier_swap${swap}" --workload prefix --num-requests 512 --num-prefixes 64 \
        --prefix-len 2048 --suffix-len 128 --output-len 64 --num-kv-blocks 256 \
        --preemption-mode recompute --swap-space "$swap"
    done
    # 3. pair.py's prefix workload: 256 requests share one 2,048-token prefix, 128 own tokens,
    #    256 new. Prefix caching on vs off.
    kv_bench prefix_cache_on --workload prefix --num-requests 256 --prefix-len 2048 --suffix-len 128 --output-len 256
    kv_bench prefix_cache_off --workload prefix --num-requests 256 --prefix-len 2048 --suffix-len 128 --output-len 256 --no-prefix-caching
    # 4. The plain throughput workload with the defaults and with swap space 0 (host tier off):
    #    the host tier's copies of evicted blocks must not slow it down.
    kv_bench throughput_default
    kv_bench throughput_swap0 --swap-space 0
  fi
}

tp() {
  gpu_env
  local what=${1:-all}
  export NANOQWEN_ALL_REDUCE_TIMEOUT_S=${NANOQWEN_ALL_REDUCE_TIMEOUT_S:-30}
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  nvidia-smi topo -m | head -4
  env | grep -E 'NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS'
  tp_bench() {  # tp_bench TP NAME ARGS...: one run, its log and JSON under $OUT
    # SIGABRT on a hang: faulthandler prints every thread's stack, so a tp=2 run that prints
    # its results and then does not exit shows where it waits.
    local tp=$1 name=$2; shift 2
    timeout -s ABRT "${BENCH_TIMEOUT_S:-300}" python3 -X faulthandler -m nanoqwen.bench \
      --tensor-parallel-size "$tp" --json "$OUT/$name.json" "$@" \
      2>&1 | grep --line-buffered -v $'\r' | tee "$OUT/$name.log"
  }
  if [[ $what == custom || $what == all ]]; then
    # Run these first: every wait in the custom all-reduce kernel gives up after
    # NANOQWEN_ALL_REDUCE_TIMEOUT_S, pytest after 9 minutes.
    timeout "${CUSTOM_TIMEOUT_S:-540}" python3 -m pytest tests/gpu/test_custom_all_reduce_gpu.py -v -rs -x \
      -p no:cacheprovider 2>&1 | tee "$OUT/custom_all_reduce_tests.log"
  fi
  if [[ $what == tests || $what == all ]]; then
    # The custom collectives on (CUSTOM=0: the NCCL default); the exit tests set both.
    NANOQWEN_CUSTOM_ALL_REDUCE=${CUSTOM:-1} timeout "${TESTS_TIMEOUT_S:-300}" python3 -m pytest \
      tests/gpu/test_tensor_parallel_gpu.py -v -rs -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu_tp_tests.log"
  fi
  if [[ $what == allreduce || $what == all ]]; then
    # The custom all-reduce's cost next to NCCL's per shape and over message sizes. SHAPES and
    # SWEEP (=0: no sweep over sizes) narrow it to fit one call with other parts.
    timeout "${ALLREDUCE_TIMEOUT_S:-540}" python3 tools/allreduce_bench.py --tp 2 \
      --shapes "${SHAPES:-7B,14B,32B,72B}" $([[ ${SWEEP:-1} == 0 ]] || echo --sweep) 2>&1 \
      | tee "$OUT/allreduce.log"
  fi
  if [[ $what == ncclenv ]]; then
    # NCCL's small-message all-reduce in a graph takes ~16 µs: does forcing its low-latency
    # protocol or one algorithm cut that? (Set before the communicator exists.)
    for env in "" "NCCL_PROTO=LL" "NCCL_PROTO=LL NCCL_ALGO=Ring" "NCCL_PROTO=LL128"; do
      echo "== ${env:-NCCL defaults}" | tee -a "$OUT/allreduce_ncclenv.log"
      env $env timeout 120 python3 tools/allreduce_bench.py --tp 2 --shapes 7B 2>&1 \
        | tee -a "$OUT/allreduce_ncclenv.log"
    done
  fi
  if [[ $what == batch1 || $what == all ]]; then
    for tp in 1 2; do
      tp_bench "$tp" "7B_batch1_tp$tp" --shape 7B --mode latency --batch-sizes 1 --sampling greedy \
        --max-num-seqs 16
    done
    # tp=2 with the custom all-reduce switched on: what it gains over NCCL
    NANOQWEN_CUSTOM_ALL_REDUCE=1 tp_bench 2 "7B_batch1_tp2_custom" --shape 7B --mode latency \
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
    tp_bench 2 "32B_tp2" --shape 32B --mode all --batch-sizes 1,64 --sampling greedy
  fi
}

# The serving benchmark, per shape of random weights:
#   1. the offline engine on the workload (LLM.generate, same engine flags): the reference;
#   2. `nanoqwen serve --random-shape SHAPE`, then the serving benchmark against it at a
#      saturating rate (all requests at once; compared with 1.) and at a moderate Poisson rate.
# Environment: SERVE_ARGS (extra server flags, e.g. "--stream-interval 4"), NUM_REQUESTS (256),
# RATE_0_5B / RATE_7B (moderate rates in requests/s, default 20 and 6), BENCH_ARGS (extra
# workload flags for both runs), DEVICE (cuda).
serve_bench() {
  # flash-attn as the other modes install it, so the engine runs as in BENCHMARKS.md.
  gpu_env optional
  bash tools/serve_wheels.sh install || exit 1
  export PYTHONPATH=/tmp/serve-site:$PYTHONPATH
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import flash_attn; print('flash_attn', flash_attn.__version__)" || echo "no flash-attn"
  local shapes=("$@"); [[ ${#shapes[@]} -eq 0 ]] && shapes=(0.5B 7B)
  local n=${NUM_REQUESTS:-256}
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  for shape in "${shapes[@]}"; do
    engine=(--random-shape "$shape" --device "${DEVICE:-cuda}" -q)
    rate_var="RATE_${shape//./_}"; rate=${!rate_var:-$([[ $shape == 0.5B ]] && echo 20 || echo 6)}
    # shellcheck disable=SC2086
    python3 -m nanoqwen.bench.serve --offline "${engine[@]}" --num-requests "$n" ${BENCH_ARGS:-} \
      --json "$OUT/offline_$shape.json" 2>&1 | tee "$OUT/offline_$shape.log"
    # shellcheck disable=SC2086
    python3 -m nanoqwen serve "${engine[@]}" --port 8000 ${SERVE_ARGS:-} \
      > "$OUT/server_$shape.log" 2>&1 &
    server=$!
    python3 - <<'PY' || { cat "$OUT/server_$shape.log"; kill $server; exit 1; }
import time, urllib.request
for _ in range(600):
    try:
        urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=2); break
    except OSError:
        time.sleep(1)
else:
    raise SystemExit("the server did not come up in 10 minutes")
PY
    # shellcheck disable=SC2086
    python3 -m nanoqwen.bench.serve --num-requests "$n" --request-rate inf ${BENCH_ARGS:-} \
      --compare "$OUT/offline_$shape.json" --json "$OUT/burst_$shape.json" \
      2>&1 | tee "$OUT/burst_$shape.log"
    # shellcheck disable=SC2086
    python3 -m nanoqwen.bench.serve --num-requests "$n" --request-rate "$rate" ${BENCH_ARGS:-} \
      --json "$OUT/rate${rate}_$shape.json" 2>&1 | tee "$OUT/rate${rate}_$shape.log"
    python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/metrics').read().decode())" \
      > "$OUT/metrics_$shape.txt"
    kill $server; wait $server
  done
}

speculation() {
  # The verify step of k = 4 at batch 1 against a plain decode step, per shape; then the GPU
  # tests of speculation, mixed steps and the float8 cache.
  gpu_env optional
  local shapes=("$@"); [[ ${#shapes[@]} -eq 0 ]] && shapes=(0.5B 7B)
  for shape in "${shapes[@]}"; do
    python3 tools/spec_step_bench.py --shape "$shape" --k 4 2>&1 | tee -a "$OUT/spec_step.log"
    # End to end at batch 1, greedy: plain, then prompt lookup at the acceptance that random
    # weights give.
    for spec in none '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}'; do
      local flag=(); [[ $spec != none ]] && flag=(--speculative-config "$spec")
      python3 -m nanoqwen.bench --shape "$shape" --mode latency --batch-sizes 1 \
        --prompt-len 512 --new-tokens 512 --temperature 0 "${flag[@]}" 2>&1 | grep -v $'\r' \
        | tee -a "$OUT/spec_e2e.log"
    done
  done
  python3 -m pytest tests/gpu/test_speculative_and_mixed_gpu.py tests/gpu/test_fp8_kv_gpu.py \
    -q -s -rs -p no:cacheprovider 2>&1 | tee "$OUT/spec_tests.log"
}

long_context() {
  # Parts (default all): 131k: 7B with YaRN (factor 4 over 32,768: Qwen2.5's documented
  # 128K setting) on random weights with Qwen's tokenizer (.peer/pair.py prepares them;
  # carry .peer), one 131,072-token prompt; streams: 64 streams while a 32K prompt arrives,
  # bf16 then fp8 KV cache; decode: 64 sequences x 8K context, bf16 then fp8 KV cache.
  gpu_env optional
  local parts=("$@"); [[ ${#parts[@]} -eq 0 ]] && parts=(131k streams decode)
  local model=(--model /tmp/pair-model-7B --max-model-len 131072)
  if [[ " ${parts[*]} " == *" 131k "* || " ${parts[*]} " == *" streams "* ]]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .peer/*.whl
    python3 .peer/pair.py --run prepare --shape 7B > /dev/null
    python3 - <<'PY'
import json, pathlib
p = pathlib.Path("/tmp/pair-model-7B/config.json")
c = json.loads(p.read_text())
c["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
p.write_text(json.dumps(c))
PY
  fi
  if [[ " ${parts[*]} " == *" 131k "* ]]; then
    python3 -m nanoqwen.bench "${model[@]}" --mode long --long-prompt-len 130944 --streams 1 \
      --max-num-batched-tokens 16384 --json "$OUT/long_131k.json" 2>&1 | grep -v $'\r' \
      | tee "$OUT/long_131k.log"
  fi
  if [[ " ${parts[*]} " == *" streams "* ]]; then
    for kv in ${KV_DTYPES:-auto fp8}; do
      python3 -m nanoqwen.bench "${model[@]}" --mode long --long-prompt-len 32768 --streams 64 \
        --max-num-batched-tokens "${BUDGET:-2048}" --kv-cache-dtype "$kv" \
        --json "$OUT/long_32k_$kv.json" 2>&1 | grep -v $'\r' | tee "$OUT/long_32k_$kv.log"
    done
  fi
  if [[ " ${parts[*]} " == *" decode "* ]]; then
    local tree
    for tree in ${TREES:-} .; do  # TREES: other nanoqwen/ trees first, as batch1 takes them
      for kv in auto fp8; do
        in_tree "$tree" "decode_64x8k_$kv" python3 -m nanoqwen.bench --shape "${FP8_SHAPE:-7B}" \
          "${DECODE_64X8K[@]}" --kv-cache-dtype "$kv"
      done
    done
  fi
}

profile_steps() {
  # Kernel profiles of the steps that miss their goals: a mixed step (7B, 64 streams beside a
  # 30K prompt, budget 256), a verify step (0.5B, k = 4), decode at 64 x 8K with the bf16
  # and the fp8 KV cache (0.5B).
  gpu_env optional
  python3 tools/profile_step.py --shape 7B --step mixed --streams 64 --prompt-len 30000 \
    --budget 256 2>&1 | tee "$OUT/profile_mixed.log"
  python3 tools/profile_step.py --shape 0.5B --step verify --k 4 2>&1 \
    | tee "$OUT/profile_verify.log"
  for kv in auto fp8; do
    python3 tools/profile_step.py --shape 0.5B --step decode --streams 64 --context 8192 \
      --kv-cache-dtype "$kv" 2>&1 | tee -a "$OUT/profile_decode_64x8k.log"
  done
  python3 tools/kernel_bench.py --shapes 0.5B,7B --fp8 2>&1 | tee "$OUT/kernel_fp8.log"
}

stream() {
  gpu_env optional
  python3 tools/stream_gemv_bench.py --budget-s "${SWEEP_S:-150}" 2>&1 | tee "$OUT/stream_gemv.log"
  python3 tools/stream_gemv_bench.py --shapes 0.5B --only lm_head --budget-s 30 2>&1 \
    | tee -a "$OUT/stream_gemv.log"
  in_trees stream_7b "$@" -- "${LATENCY_7B[@]}"
  python3 tools/profile_decode.py --shape 7B --batch-sizes 1 --kernels 2>&1 \
    | tee "$OUT/stream_profile_7b.log"
}

fp8_kernel() {
  gpu_env optional
  in_trees fp8_kernel "$@" -- python3 "$PWD/tools/kernel_bench.py" --fp8-default
}

int4() {
  gpu_env optional
  python3 tools/quant_kernel_bench.py --shapes 7B --sections stack,mma --formats q4g128o \
    --sweep-budget-s "${SWEEP_S:-120}" 2>&1 | tee "$OUT/int4_kernels.log"
  in_trees int4 "$@" -- "${LATENCY_7B[@]}" --quantization int4
  in_tree . int4_bf16 "${LATENCY_7B[@]}" --quantization none
}

# goals: see the usage notes at the top.
goals() {
  gpu_env optional
  export DEADLINE=${DEADLINE:-570}
  local parts=" ${GOALS_PARTS:-fp8 7b small} " kv quant
  nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/goals_gpu.log"
  if [[ $parts == *" fp8 "* ]]; then
    for kv in auto fp8; do
      within 150 in_tree . "goals_fp8_$kv" python3 -m nanoqwen.bench --shape 7B \
        "${DECODE_64X8K[@]}" --kv-cache-dtype "$kv"
    done
    within 120 in_tree . goals_fp8_tests python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_fp8_kv_gpu.py tests/kernels/triton/test_fp8_kv_cache.py
    goals_ratio "float8 / bf16 KV, 64 x 8K" goals_fp8_auto goals_fp8_fp8
  fi
  if [[ $parts == *" 7b "* ]]; then
    for quant in none int4; do
      within 100 in_tree . "goals_7b_$quant" "${LATENCY_7B[@]}" --quantization "$quant"
    done
    goals_ratio "int4 / bf16, 7B batch 1" goals_7b_none goals_7b_int4
  fi
  [[ $parts == *" small "* ]] && within 90 in_tree . goals_small "${PRESETS_05B[@]}"
  if [[ $parts == *" pair "* ]]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .peer/*.whl
    for shape in 0.5B 7B; do
      within 200 in_tree . "goals_pair_$shape" python3 .peer/pair.py --shape "$shape" \
        --workload batch1 --reps 3
    done
  fi
}

# goals_ratio TITLE BEFORE AFTER: step p50 of BEFORE's first result row over AFTER's (the
# speed-up), from their logs.
goals_ratio() {
  local a b
  a=$(grep -hE "^[0-9]+ \|" "$OUT/$2_checkout.log" 2>/dev/null | head -1 | cut -d'|' -f6)
  b=$(grep -hE "^[0-9]+ \|" "$OUT/$3_checkout.log" 2>/dev/null | head -1 | cut -d'|' -f6)
  [[ -n $a && -n $b ]] && python3 -c "print('$1: $a / $b ms =', round($a / $b, 3))" \
    | tee -a "$OUT/goals_ratios.log"
}

mode=${1:-}; shift || true
case $mode in
  check) check "$@" ;;
  kv-cache) kv_cache "$@" ;;
  tp) tp "$@" ;;
  serve-bench) serve_bench "$@" ;;
  speculation) speculation "$@" ;;
  long-context) long_context "$@" ;;
  profile-steps) profile_steps "$@" ;;
  batch1) batch1 "$@" ;;
  ab) ab "$@" ;;
  sampling) sampling "$@" ;;
  int4) int4 "$@" ;;
  stream) stream "$@" ;;
  fp8-kernel) fp8_kernel "$@" ;;
  goals) goals "$@" ;;
  *) usage ;;
esac
