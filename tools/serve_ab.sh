#!/usr/bin/env bash
# The serving benchmark's burst (all requests at once, the throughput workload) against two
# servers on one GPU, one per tree, alternating round by round:
#   bash tools/serve_ab.sh SHAPE ROUNDS BEFORE_DIR AFTER_DIR
# Each tree directory holds a `nanoqwen/` package; run from the repo root once the flash-attn
# and serve wheels are installed in /tmp/site and /tmp/serve-site (tools/gpu.sh's set-up).
# Both servers get the same fixed KV pool: --gpu-memory-utilization counts the other
# server's memory too. Results go to $OUT/burst_PORT_ROUND.json (8001: before, 8002: after).
shape=$1; rounds=$2; before=$(realpath "$3"); after=$(realpath "$4"); n=${NUM_REQUESTS:-256}
root=$PWD
start() {  # dir port
  (cd "$1" && PYTHONPATH=/tmp/serve-site:/tmp/site:$1 python3 -m nanoqwen serve --random-shape "$shape" \
     --device "${DEVICE:-cuda}" -q --port "$2" --num-kv-blocks 2000 > "$OUT/server_$2.log" 2>&1) &
}
start "$before" 8001; pb=$!
start "$after" 8002; pa=$!
for port in 8001 8002; do
  python3 - "$port" <<'PY' || { tail -30 "$OUT/server_$port.log"; exit 1; }
import sys, time, urllib.request
for _ in range(600):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2); break
    except OSError:
        time.sleep(1)
else:
    raise SystemExit("no server")
PY
done
for r in $(seq 0 "$rounds"); do
  for port in 8001 8002; do
    PYTHONPATH=/tmp/serve-site:/tmp/site:$root python3 -m nanoqwen.bench.serve --base-url "http://127.0.0.1:$port" \
      --num-requests "$n" --request-rate inf ${BENCH_ARGS:-} --json "$OUT/burst_${port}_$r.json" > "$OUT/burst_${port}_$r.log" 2>&1
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('round', sys.argv[2], 'before' if sys.argv[3]=='8001' else 'after ', round(d['output_tok_s'],1), 'tok/s')" \
      "$OUT/burst_${port}_$r.json" "$r" "$port"
  done
done
pkill -f "nanoqwen serve --random-shape"; wait
