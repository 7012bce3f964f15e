"""GPU time of one decode-attention call, captured 20 times in a CUDA graph.

The Triton decode kernel (kernels/triton/decode_attention.py) over tile sizes, warps and split
counts, next to flash_attn_with_kvcache as the flash-attn backend calls it. The same K/V is
read 20 times, so small contexts sit in L2: compare kernels here, and confirm a choice with
tools/profile_decode.py, which times the kernels inside the real decode graph.

Usage: python tools/kernel_bench.py [--shapes 0.5B,7B] [--large | --balance | --fp8 |
--fp8-default]
"""

from __future__ import annotations

import argparse
import itertools
from contextlib import contextmanager

import torch
from gpu_timing import graph_us

import nanoqwen.kernels.triton.decode_attention as da
from nanoqwen.attention.rotary import RotaryEmbedding
from nanoqwen.model.shapes import shape_config

PAGE = 256


@contextmanager
def forced(tile: int, warps: int, stages: int):
    """The decode kernel's tile, warps and pipeline depth at every batch size."""
    saved = da.tile_config, da.NUM_STAGES
    da.tile_config = lambda *args: (tile, warps)
    da.NUM_STAGES = stages
    try:
        yield
    finally:
        da.tile_config, da.NUM_STAGES = saved


class DecodeStep:
    """One decode step of sequences with these context lengths (new token included), their
    blocks shuffled over the pool: the decode kernel's inputs, and caches for it to read."""

    def __init__(self, shape: str, lens: torch.Tensor) -> None:
        cfg = shape_config(shape)
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        )  # fmt: skip
        bs = len(lens)
        dev = self.dev = torch.device("cuda")
        self.gen = torch.Generator(device=dev).manual_seed(0)
        self.rotary = RotaryEmbedding(self.head_dim, 40960, cfg.rope_theta, dev)
        self.tokens = int(lens.sum())
        width = -(-int(lens.max()) // PAGE)
        self.blocks = bs * width + 1
        perm = torch.randperm(self.blocks - 1, device=dev, generator=self.gen)
        self.tables = perm.to(torch.int32).view(bs, width)
        width_qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.qkv = torch.randn(bs, width_qkv, device=dev, dtype=torch.bfloat16, generator=self.gen)
        self.ctx = lens.to(device=dev, dtype=torch.int32)
        self.pos = (self.ctx - 1).long()
        block = self.tables[torch.arange(bs, device=dev), self.pos // PAGE].long()
        self.slots = block * PAGE + self.pos % PAGE

    def cache(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.blocks, PAGE, self.kv_heads, self.head_dim)
        k, v = (torch.randn(shape, device=self.dev, generator=self.gen) for _ in range(2))
        return k.to(dtype), v.to(dtype)

    def kv_bytes(self, cache: torch.Tensor) -> int:
        """The K and V bytes the step reads: what a memory-bound kernel's time is measured
        against."""
        return self.tokens * self.kv_heads * self.head_dim * 2 * cache.element_size()

    def attend(self, k, v, num_splits: int = 0, order=None) -> torch.Tensor:
        return da.decode_attention(
            self.qkv, self.pos, self.slots, self.ctx, self.tables, self.rotary.cos_half,
            self.rotary.sin_half, k, v, self.head_dim**-0.5, num_splits=num_splits,
            order=order,
        )  # fmt: skip


def attention(shape: str, batch_sizes, contexts, sweep: bool, balance: bool = False) -> None:
    for bs, ctx in itertools.product(batch_sizes, contexts):
        attention_case(shape, bs, ctx, sweep, balance)


def attention_case(shape: str, bs: int, ctx: int, sweep: bool, balance: bool) -> None:
    """ctx 0: every sequence's context drawn from U[100, 2048] (the throughput workload's
    spread), else all equal."""
    from flash_attn import flash_attn_with_kvcache

    gen = torch.Generator(device="cpu").manual_seed(0)
    lens = torch.randint(100, 2049, (bs,), generator=gen) if ctx == 0 else torch.full((bs,), ctx)
    step = DecodeStep(shape, lens)
    k_cache, v_cache = step.cache(torch.bfloat16)
    h, d, width = step.heads, step.head_dim, step.tables.shape[1]
    q = step.qkv[:, : h * d].reshape(bs, 1, h, d)
    # The flash-attn backend's decode: RoPE and the K/V write done (rope_and_store), then
    # attention alone over a table as wide as the model's (the graph's).
    fa_tables = torch.zeros(bs, max(width, 16), dtype=torch.int32, device=step.dev)
    fa_tables[:, :width] = step.tables

    def fa(splits):
        flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=step.ctx, block_table=fa_tables,
            softmax_scale=d**-0.5, causal=True, num_splits=splits,
        )  # fmt: skip

    def tr(splits=0, order=None):
        step.attend(k_cache, v_cache, num_splits=splits, order=order)

    longest_first = step.ctx.argsort(descending=True).to(torch.int32)
    kv_bytes = step.kv_bytes(k_cache)
    row = {f"flash splits={s}": graph_us(lambda s=s: fa(s)) for s in (0, 1, 2, 3, 4)}
    row["triton default"] = graph_us(tr)
    if balance:  # split counts, and the longest contexts launched first
        for splits, first in itertools.product((0, 1, 2, 4, 8), (False, True)):
            if splits == 0 and not first:  # "triton default" above
                continue
            name = f"triton splits={splits or 'default'}" + (" longest-first" if first else "")
            row[name] = graph_us(lambda s=splits, f=first: tr(s, longest_first if f else None))
    if sweep:
        for tile, warps, stages, splits in itertools.product(
            (32, 64, 128), (1, 2, 4, 8), (2, 3, 4), (1, 2, 4)
        ):
            try:
                with forced(tile, warps, stages):
                    us = graph_us(lambda s=splits: tr(s))
            except Exception as e:  # out of shared memory at large tiles and stages
                print(f"  tile={tile} warps={warps} stages={stages}: {type(e).__name__}")
                continue
            row[f"triton tile={tile} warps={warps} stages={stages} splits={splits}"] = us
    best_fa = min((v, k) for k, v in row.items() if k.startswith("flash"))
    best = sorted((v, k) for k, v in row.items() if k.startswith("triton"))[: 8 if balance else 4]
    label = "U[100,2048]" if ctx == 0 else str(ctx)
    fa_rate = kv_bytes / best_fa[0] / 1e6
    print(
        f"{shape} bs {bs} ctx {label} ({kv_bytes / 1e6:.0f} MB of KV): "
        + " | ".join(f"{k} {v:.1f}" for k, v in row.items() if k.startswith("flash"))
        + f" | triton default {row['triton default']:.1f} µs"
        + f"\n    best flash {best_fa[1]} {best_fa[0]:.1f} µs ({fa_rate:.2f} TB/s);"
        + " best triton: "
        + "; ".join(f"{k[7:]} {v:.1f} ({kv_bytes / v / 1e6:.2f} TB/s)" for v, k in best),
        flush=True,
    )


def fp8_sweep(shape: str, bs: int, ctx: int) -> None:
    """The Triton decode kernel over a bfloat16 and a float8 cache of bs sequences of ctx
    tokens, over tile sizes, warps and split counts: a float8 tile of the same keys
    moves half the bytes, so its best tile, split count or depth may differ."""
    step = DecodeStep(shape, torch.full((bs,), ctx))
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        k_cache, v_cache = step.cache(kv_dtype)
        kv_bytes = step.kv_bytes(k_cache)
        row = {}
        for tile, warps, splits in itertools.product((64, 128, 256), (1, 2, 4), (0, 1, 2, 4, 8)):

            def tr(s=splits, k=k_cache, v=v_cache):
                step.attend(k, v, num_splits=s)

            try:
                with forced(tile, warps, da.NUM_STAGES):
                    us = graph_us(tr)
                row[f"tile={tile} warps={warps} splits={splits or 'default'}"] = us
            except Exception as e:  # out of shared memory or registers
                print(f"  tile={tile} warps={warps}: {type(e).__name__}")
        default = da.tile_config(bs, step.kv_heads, step.head_dim, kv_dtype.itemsize == 1, PAGE)
        best = sorted((v, k) for k, v in row.items())[:4]
        print(
            f"{shape} bs {bs} ctx {ctx} {str(kv_dtype).removeprefix('torch.')} "
            f"({kv_bytes / 1e6:.0f} MB of KV): default "
            f"{row.get(f'tile={default[0]} warps={default[1]} splits=default', float('nan')):.1f}"
            " µs; best: "
            + "; ".join(f"{k} {v:.1f} ({kv_bytes / v / 1e6:.2f} TB/s)" for v, k in best),
            flush=True,
        )


def fp8_default(shape: str, bs: int, ctx: int) -> None:
    """The decode kernel as launched (its default tile, warps and splits) over a bfloat16 and
    a float8 cache of the same keys and values, three timings each, and how far the float8
    cache's output lies from the bfloat16 one's: the figure an A/B of trees compares
    (`tools/gpu.sh fp8-kernel DIR...`)."""
    step = DecodeStep(shape, torch.full((bs,), ctx))
    k16, v16 = step.cache(torch.bfloat16)
    outs = {}
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        k, v = k16.to(kv_dtype), v16.to(kv_dtype)
        outs[kv_dtype] = step.attend(k, v).float()
        runs = [graph_us(lambda k=k, v=v: step.attend(k, v)) for _ in range(3)]
        median = sorted(runs)[1]
        print(
            f"{shape} bs {bs} ctx {ctx} {str(kv_dtype).removeprefix('torch.')}: "
            f"{median:.1f} µs ({step.kv_bytes(k) / median / 1e6:.2f} TB/s; runs "
            + ", ".join(f"{u:.1f}" for u in runs)
            + ")",
            flush=True,
        )
    gap = (outs[torch.float8_e4m3fn] - outs[torch.bfloat16]).abs().max().item()
    print(f"{shape} bs {bs} ctx {ctx}: max |float8 - bfloat16| output {gap:.4f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="0.5B,7B")
    p.add_argument("--large", action="store_true", help="large decode batches, swept")
    p.add_argument("--balance", action="store_true", help="split counts and launch order")
    p.add_argument("--fp8", action="store_true", help="bf16 vs float8 cache, 64 x 8K")
    p.add_argument(
        "--fp8-default", action="store_true", help="bf16 vs float8 cache, 64 x 8K, as launched"
    )
    args = p.parse_args()
    for shape in args.shapes.split(","):
        if args.fp8_default:
            fp8_default(shape, 64, 8192)
            continue
        if args.fp8:
            fp8_sweep(shape, 64, 8192)
            continue
        if args.balance:  # the throughput workload's decode batches, as its batch decays
            attention(shape, [32, 64, 96, 128, 192, 256], [0, 1024], False, balance=True)
            continue
        if args.large:  # the throughput workload's decode batches
            attention(shape, [64, 128, 256], [0, 1024], sweep=True)
            continue
        attention(shape, [1], [384, 4096], sweep=True)
        attention(shape, [8, 32, 128], [384, 1024], sweep=False)


if __name__ == "__main__":
    main()
