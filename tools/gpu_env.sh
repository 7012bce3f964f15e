# Sourced by the device scripts (gpu_check.sh, gpu_tp.sh): unbuffered output, $OUT, and the
# flash-attn wheel from .whl installed onto PYTHONPATH (FLASH_ATTN=0: run without it).
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [[ ${FLASH_ATTN:-1} != 0 ]]; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
