#!/usr/bin/env bash
# The wheels `nanoqwen serve` and its benchmark need on a machine without network (the GPU
# machine: Python 3.12, x86_64 Linux): the serve extra and the clients the benchmark and
# tests use (httpx, openai), with their dependencies.
#   bash tools/serve_wheels.sh download [DIR]   # here, with network (default DIR .serve-wheels)
#   bash tools/serve_wheels.sh install [DIR]    # there: into /tmp/serve-site, for PYTHONPATH
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-download}
dir=${2:-.serve-wheels}
packages=(fastapi uvicorn prometheus-client uvloop httptools httpx openai)
case $what in
  download)
    python3 -m pip download --only-binary=:all: --python-version 3.12 \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 -d "$dir" "${packages[@]}"
    ;;
  install)
    python3 -m pip install -q --no-index --find-links "$dir" --target /tmp/serve-site \
      "${packages[@]}"
    echo "installed into /tmp/serve-site: export PYTHONPATH=/tmp/serve-site:\$PYTHONPATH"
    ;;
  *)
    echo "usage: bash tools/serve_wheels.sh download|install [DIR]" >&2
    exit 2
    ;;
esac
