#!/usr/bin/env bash
# Issue 9 on the GPU: the swap / host-tier tests, then swap vs recompute under a pool a quarter
# of the batch needs, host tier on vs off for prefixes that fit the host pool but not the GPU
# pool, and the shared-prefix workload with prefix caching on vs off.
# Usage (device tool, carry .whl): bash tools/gpu_kv_cache.sh [tests|bench|all] [0.5B|7B]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
what=${1:-all}
shape=${2:-0.5B}
bench() {  # name, then bench flags
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
    bench "quarter_${mode}_nocache" --num-kv-blocks 280 --preemption-mode "$mode" --swap-space 16 --no-prefix-caching
    bench "quarter_${mode}" --num-kv-blocks 280 --preemption-mode "$mode" --swap-space 16
  done
  # 2. 64 prefixes of 2,048 tokens (131k tokens) asked round-robin: 256 GPU blocks (65k
  #    tokens) cannot keep them, 16 GiB of host memory can. Host tier on vs off.
  for swap in 16 0; do
    bench "host_tier_swap${swap}" --workload prefix --num-requests 512 --num-prefixes 64 \
      --prefix-len 2048 --suffix-len 128 --output-len 64 --num-kv-blocks 256 \
      --preemption-mode recompute --swap-space "$swap"
  done
  # 3. The workload (pair.py --workload prefix): 256 requests share one 2,048-token
  #    prefix, 128 own tokens, 256 new. Prefix caching on vs off.
  bench prefix_cache_on --workload prefix --num-requests 256 --prefix-len 2048 --suffix-len 128 --output-len 256
  bench prefix_cache_off --workload prefix --num-requests 256 --prefix-len 2048 --suffix-len 128 --output-len 256 --no-prefix-caching
  # 4. The plain throughput workload with the defaults and with swap space 0 (host tier off):
  #    the host tier's copies of evicted blocks must not slow it down.
  bench throughput_default
  bench throughput_swap0 --swap-space 0
fi
