"""GPU time of one decode-attention call, captured 20 times in a CUDA graph.

The Triton decode kernel (kernels/decode_attention.py) over tile sizes, warps and split
counts, next to flash_attn_with_kvcache as the flash-attn backend calls it. The same K/V is
read 20 times, so small contexts sit in L2: compare kernels here, and confirm a choice with
tools/profile_decode.py, which times the kernels inside the real decode graph.

Usage: python tools/kernel_bench.py [--shapes 0.5B,7B]
"""

from __future__ import annotations

import argparse
import itertools

import torch
from gpu_timing import graph_us

import nanoqwen.kernels.decode_attention as da
from nanoqwen.model.layers import RotaryEmbedding
from nanoqwen.model.shapes import shape_config

PAGE = 256


def attention(shape: str, batch_sizes, contexts, sweep: bool) -> None:
    for bs, ctx in itertools.product(batch_sizes, contexts):
        attention_case(shape, bs, ctx, sweep)


def attention_case(shape: str, bs: int, ctx: int, sweep: bool) -> None:
    from flash_attn import flash_attn_with_kvcache

    cfg = shape_config(shape)
    h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dev, dtype = torch.device("cuda"), torch.bfloat16
    rotary = RotaryEmbedding(d, 40960, cfg.rope_theta, dev)
    cos, sin = rotary.cos_half.to(dtype), rotary.sin_half.to(dtype)
    width = -(-ctx // PAGE)
    blocks = bs * width + 1
    k_cache = torch.randn(blocks, PAGE, kvh, d, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(blocks - 1, device=dev).to(torch.int32).view(bs, width)
    qkv = torch.randn(bs, (h + 2 * kvh) * d, device=dev, dtype=dtype)
    ctx_t = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
    pos = (ctx_t - 1).long()
    slots = tables[:, (ctx - 1) // PAGE].long() * PAGE + (ctx - 1) % PAGE
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], -1)
    q, k, v = q.view(bs, 1, h, d), k.reshape(bs, 1, kvh, d), v.reshape(bs, 1, kvh, d)
    # The flash-attn backend's graphs: a 2,048-token table with one split, else the
    # full 32k table with flash-attn's own split heuristic.
    fa_width, fa_splits = (8, 1) if ctx <= 2048 else (128, 0)
    fa_tables = torch.zeros(bs, fa_width, dtype=torch.int32, device=dev)
    fa_tables[:, :width] = tables

    def fa(splits=fa_splits, t=fa_tables):
        flash_attn_with_kvcache(
            q, k_cache, v_cache, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
            cache_seqlens=ctx_t - 1, block_table=t, causal=True,
            rotary_interleaved=False, num_splits=splits,
        )  # fmt: skip

    def tr(splits=0):
        da.decode_attention(
            qkv, pos, slots, ctx_t, tables, rotary.cos_half, rotary.sin_half,
            k_cache, v_cache, d**-0.5, num_splits=splits,
        )  # fmt: skip

    row = {"flash-attn (backend)": graph_us(fa)}
    if ctx <= 2048:
        row["flash-attn splits=heuristic"] = graph_us(lambda: fa(0))
    row["triton default"] = graph_us(tr)
    if sweep:
        for tile, warps, splits in itertools.product((32, 64, 128), (2, 4), (4, 8, 16, 32)):
            da.TILE, da.NUM_WARPS = tile, warps
            row[f"triton tile={tile} warps={warps} splits={splits}"] = graph_us(
                lambda s=splits: tr(s)
            )
        da.TILE, da.NUM_WARPS = 64, 4
    best = min((v, k) for k, v in row.items() if k.startswith("triton"))
    print(
        f"{shape} bs {bs} ctx {ctx}: "
        + " | ".join(f"{k} {v:.1f}" for k, v in row.items() if not k.startswith("triton "))
        + f" | triton default {row['triton default']:.1f} | best {best[1]} {best[0]:.1f} µs",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="0.5B,7B")
    args = p.parse_args()
    for shape in args.shapes.split(","):
        attention(shape, [1], [384, 4096], sweep=True)
        attention(shape, [8, 32, 128], [384, 1024], sweep=False)


if __name__ == "__main__":
    main()
