#!/usr/bin/env bash
# One device call: install the flash-attn wheel, run the GPU tests, then the benchmarks.
# Usage (device tool, carry .whl):
#   bash tools/gpu_check.sh [tests|bench|all|kernels|profile|prefill|workload] [args...]
# workload [SHAPE] [WORKLOAD]: tools/profile_workload.py for nanoqwen and nano-vllm (carry
# .peer too), 7B throughput by default.
# FLASH_ATTN=0 skips the wheel: everything then runs as on a GPU without flash-attn.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
what=${1:-all}; shift || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
python3 -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>/dev/null || echo "flash_attn: not installed"
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest tests/gpu -q -rs -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
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
