#!/usr/bin/env bash
# The serving benchmark on a GPU machine (issue 10), per shape of random weights:
#   1. the offline engine on the workload (LLM.generate, same engine flags): the reference;
#   2. `nanoqwen serve --random-shape SHAPE`, then the serving benchmark against it at a
#      saturating rate (all requests at once; compared with 1.) and at a moderate Poisson rate.
# Usage (device tool, carry .serve-wheels and .whl): bash tools/serve_gpu_bench.sh [SHAPE ...]
# Environment: SERVE_ARGS (extra server flags, e.g. "--stream-interval 4"), NUM_REQUESTS (256),
# RATE_0_5B / RATE_7B (moderate rates in requests/s, default 20 and 6), BENCH_ARGS (extra
# workload flags for both runs), DEVICE (cuda).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash tools/serve_wheels.sh install || exit 1
# flash-attn as tools/gpu_check.sh installs it (carry .whl), so the engine runs as in BENCHMARKS.md.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/serve-site:/tmp/site:$PWD
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "import flash_attn; print('flash_attn', flash_attn.__version__)" || echo "no flash-attn"
shapes=("$@"); [[ ${#shapes[@]} -eq 0 ]] && shapes=(0.5B 7B)
n=${NUM_REQUESTS:-256}
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
