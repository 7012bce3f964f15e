"""`nanoqwen bench` and `python -m nanoqwen.runtime.bench`: decode latency and serving
throughput on random weights of real Qwen2.5 shapes, optionally side by side with HF."""

from nanoqwen.runtime.bench.args import add_arguments
from nanoqwen.runtime.bench.command import run

__all__ = ["add_arguments", "run"]  # what `nanoqwen bench` (cli_parser.BENCH_MODULE) calls
