"""`nanoqwen bench` and `python -m nanoqwen.bench`: decode latency and serving
throughput on random weights of real Qwen2.5 shapes, optionally side by side with HF."""

from nanoqwen.bench.args import add_arguments
from nanoqwen.bench.command import run

__all__ = ["add_arguments", "run"]  # what `nanoqwen bench` (cli_parser.BENCH_MODULE) calls
