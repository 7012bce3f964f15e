"""GPU time of one layer's attention in a mixed step's graph bucket: running streams' one new
token each beside a chunk of a long prompt, a padding sequence up to the bucket's rows, as
runtime/prefill_graph.py lays a mixed step out (bf16, block size 256, random K/V).

Rows: the Triton prefill kernel with the split count it picks in the graph (max_seqlen_k =
--max-model-len) and with fixed counts; --reference PATH, another copy of
kernels/triton/prefill_attention.py (e.g. an older commit's), timed alike; flash-attn's varlen
forward over the same rows without padding where it imports, and the largest difference to it.

    python3 tools/mixed_attention_bench.py --shape 7B --streams 64 --budget 256 \
        --contexts 2048,8192,32768 [--reference .head/nanoqwen/kernels/triton/prefill_attention.py]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util

import gpu_timing
import torch

import nanoqwen.kernels.triton.prefill_attention as pa
from nanoqwen.model.shapes import shape_config

BLOCK = 256
graph_us = functools.partial(gpu_timing.graph_us, reps=10, iters=20)


class MixedBucket:
    """runs: (cached, new) per sequence; the rows are padded with one more sequence up to
    `bucket` rows, whose one block is the scratch block 0."""

    def __init__(self, shape: str, runs: list[tuple[int, int]], bucket: int) -> None:
        cfg = shape_config(shape)
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        dev, i32 = torch.device("cuda"), dict(dtype=torch.int32, device="cuda")
        rows = sum(n for _, n in runs)
        runs = runs + [(0, bucket - rows)]
        width = max(-(-(c + n) // BLOCK) for c, n in runs)
        used = [-(-(c + n) // BLOCK) for c, n in runs[:-1]]
        self.k_cache = torch.randn(sum(used) + 1, BLOCK, kvh, d, device=dev, dtype=torch.bfloat16)
        self.v_cache = torch.randn_like(self.k_cache)
        ids = (torch.randperm(sum(used), device=dev) + 1).split(used)
        self.tables = torch.zeros(len(runs), width, **i32)
        for i, row in enumerate(ids):
            self.tables[i, : len(row)] = row
        self.q = torch.randn(bucket, h, d, device=dev, dtype=torch.bfloat16)
        self.cu_q = torch.tensor([0] + [sum(n for _, n in runs[: i + 1]) for i in range(len(runs))],
                                 **i32)  # fmt: skip
        self.ctx = torch.tensor([c + n for c, n in runs], **i32)
        self.runs, self.bucket, self.d = runs, bucket, d
        real = runs[:-1]
        ends = [0] + [sum(c + m for c, m in real[: i + 1]) for i in range(len(real))]
        self.cu_k = torch.tensor(ends, **i32)

    def call(self, module, **kw) -> torch.Tensor:
        return module.prefill_attention(
            self.q, self.k_cache, self.v_cache, self.tables, self.cu_q, self.ctx, self.bucket,
            self.d**-0.5, **kw,
        )  # fmt: skip

    def flash(self) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func

        real = self.runs[:-1]
        rows = sum(m for _, m in real)
        return flash_attn_varlen_func(
            self.q[:rows], self.k_cache, self.v_cache, cu_seqlens_q=self.cu_q[: len(real) + 1],
            cu_seqlens_k=self.cu_k, max_seqlen_q=max(m for _, m in real),
            max_seqlen_k=max(c + m for c, m in real), softmax_scale=self.d**-0.5, causal=True,
            block_table=self.tables[: len(real)],
        )  # fmt: skip


def load_reference(path: str):
    spec = importlib.util.spec_from_file_location("reference_prefill_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="7B")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--stream-context", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--contexts", default="2048,8192,32768", help="the chunk's context ends")
    ap.add_argument("--max-model-len", type=int, default=40960)
    ap.add_argument("--splits", default="1,2,4,8")
    ap.add_argument("--reference", help="another prefill_attention.py to time alike")
    a = ap.parse_args()
    reference = load_reference(a.reference) if a.reference else None
    bucket = 1 << (a.budget - 1).bit_length()
    chunk = a.budget - a.streams
    print(f"{a.shape}: {a.streams} streams at {a.stream_context} + a chunk of {chunk}, "
          f"bucket {bucket}; µs per layer")  # fmt: skip
    for end in (int(x) for x in a.contexts.split(",")):
        runs = [(a.stream_context - 1, 1)] * a.streams + [(end - chunk, chunk)]
        case = MixedBucket(a.shape, runs, bucket)
        real = a.streams + chunk
        print(f"\nchunk ending at {end}:")
        row = {"auto": graph_us(lambda c=case: c.call(pa, max_seqlen_k=a.max_model_len))}
        for s in (int(x) for x in a.splits.split(",")):
            row[f"splits {s}"] = graph_us(lambda c=case, s=s: c.call(pa, num_splits=s))
        for label, part in (("chunk alone", runs[-1:]), ("streams alone", runs[:-1])):
            alone = MixedBucket(a.shape, part, bucket)
            row[f"auto, {label}"] = graph_us(
                lambda c=alone: c.call(pa, max_seqlen_k=a.max_model_len)
            )
        if reference is not None:
            row["reference"] = graph_us(lambda c=case: c.call(reference))
        try:
            ref = case.flash()
            row["flash-attn (no padding)"] = graph_us(case.flash)
            diff = (case.call(pa, max_seqlen_k=a.max_model_len)[:real] - ref).abs().max().item()
            row["max abs diff vs flash-attn"] = diff
        except ImportError:
            pass
        for k, v in row.items():
            print(f"  {k:28s} {v:10.{4 if k.startswith('max') else 1}f}", flush=True)


if __name__ == "__main__":
    main()
