"""Attention kernels against float64: the Triton decode and prefill kernels and the torch
path, on the same bfloat16 inputs (q rotated with HF's rounding, the keys as the torch path
writes them), at head shapes and input scales where softmax is flat (scale 1) or peaked
(scale 4: q and k four times larger, as in tests' tiny models of initializer_range 0.2).

Bit-level agreement between two bfloat16 kernels says little: both round. Against float64
each kernel's own error shows, and two kernels that agree by sharing an error stand out.

    python3 tools/attention_accuracy.py [--scales 1,4] [--block 16]
On a machine without a GPU, TRITON_INTERPRET=1 and --device cpu --dtype float16 run it in
Triton's interpreter (slowly; --small).
"""

from __future__ import annotations

import argparse
import itertools

import torch

from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.attention.rotary import RotaryEmbedding
from nanoqwen.attention.torch_backend import TorchAttention
from nanoqwen.attention.triton_backend import TritonAttention

HEADS = {"tiny": (4, 2, 64), "0.5B": (14, 2, 64), "7B": (28, 4, 128)}


def paged_step(runs, heads, kv_heads, head_dim, block, scale, dtype, dev, seed=0):
    """qkv, caches and metadata for sequences of (cached, new) tokens over shuffled blocks;
    cached K/V random, q and k times scale."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-(c + n) // block) for c, n in runs]
    perm = torch.randperm(sum(widths) + 1, generator=gen)
    tables = torch.zeros(len(runs), max(widths), dtype=torch.int32)
    first = 0
    for i, w in enumerate(widths):
        tables[i, :w] = perm[first : first + w]
        first += w
    shape = (sum(widths) + 1, block, kv_heads, head_dim)
    k_cache = (torch.randn(shape, generator=gen) * scale).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    tokens = sum(n for _, n in runs)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    qkv[:, : (heads + kv_heads) * head_dim] *= scale
    positions = [p for c, n in runs for p in range(c, c + n)]
    seq_of = [i for i, (_, n) in enumerate(runs) for _ in range(n)]
    slots = [int(tables[i, p // block]) * block + p % block for i, p in zip(seq_of, positions)]
    cu_q = list(itertools.accumulate([0] + [n for _, n in runs]))
    cu_k = list(itertools.accumulate([0] + [c + n for c, n in runs]))
    i32 = dict(dtype=torch.int32, device=dev)
    meta = AttentionMetadata(
        is_prefill=any(n > 1 for _, n in runs),
        positions=torch.tensor(positions, device=dev),
        slot_mapping=torch.tensor(slots, device=dev),
        context_lens=torch.tensor([c + n for c, n in runs], **i32),
        block_tables=tables.to(dev),
        cu_seqlens_q=torch.tensor(cu_q, **i32),
        max_seqlen_q=max(n for _, n in runs),
        max_seqlen_k=max(c + n for c, n in runs),
        cu_seqlens_k=torch.tensor(cu_k, **i32),
    )
    return qkv.to(dtype).to(dev), k_cache.to(dev), v_cache.to(dev), meta


def float64_attention(qkv, k_cache, v_cache, meta, rotary, heads, kv_heads, head_dim, dtype):
    """Causal attention in float64 over the cache as the torch path left it (new keys in),
    q rotated as HF rotates it in dtype."""
    half = head_dim // 2
    q = qkv[:, : heads * head_dim].view(-1, heads, head_dim)
    pos = meta.positions.long()
    cos = rotary.cos_half[pos].to(dtype).float().repeat(1, 2)[:, None]
    sin = rotary.sin_half[pos].to(dtype).float().repeat(1, 2)[:, None]
    swapped = torch.cat([-q[..., half:], q[..., :half]], -1)
    q = ((q.float() * cos).to(dtype).float() + (swapped.float() * sin).to(dtype).float()).to(dtype)
    block = k_cache.shape[1]
    keys = k_cache.view(-1, kv_heads, head_dim).double()
    values = v_cache.view(-1, kv_heads, head_dim).double()
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    cu = meta.cu_seqlens_q.tolist()
    for i in range(len(cu) - 1):
        n = int(meta.context_lens[i])
        at = torch.arange(n, device=q.device)
        slots = meta.block_tables[i, at // block].long() * block + at % block
        k = keys[slots].repeat_interleave(heads // kv_heads, 1)
        v = values[slots].repeat_interleave(heads // kv_heads, 1)
        for row in range(cu[i], cu[i + 1]):
            seen = int(pos[row]) + 1
            s = torch.einsum("hd,nhd->hn", q[row].double(), k[:seen]) * head_dim**-0.5
            out[row] = torch.einsum("hn,nhd->hd", s.softmax(-1), v[:seen])
    return out


def errors(runs, shape, block, scale, dtype, dev) -> dict[str, tuple[float, float]]:
    heads, kv_heads, head_dim = HEADS[shape]
    qkv, k_cache, v_cache, meta = paged_step(runs, heads, kv_heads, head_dim, block, scale,
                                             dtype, dev)  # fmt: skip
    rotary = RotaryEmbedding(head_dim, 4096, 1e6, dev)
    outputs = {}
    for name, backend in (("torch", TorchAttention(rotary, head_dim**-0.5)),
                          ("triton", TritonAttention(rotary, head_dim**-0.5, False))):  # fmt: skip
        k, v = k_cache.clone(), v_cache.clone()
        outputs[name] = backend.forward(qkv.clone(), k, v, meta).double()
        if name == "torch":
            written = (k, v)
    ref = float64_attention(qkv, *written, meta, rotary, heads, kv_heads, head_dim, dtype)
    return {
        name: ((out - ref).abs().max().item(), (out - ref).abs().mean().item())
        for name, out in outputs.items()
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="tiny,0.5B,7B")
    p.add_argument("--scales", default="1,4")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--small", action="store_true", help="short contexts (the interpreter)")
    args = p.parse_args()
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    lengths = [1, 17, 40] if args.small else [1, 2, 17, 64, 100, 129, 700]
    cases = {
        "decode": [(n - 1, 1) for n in lengths],
        "prefill": [(0, 24), (40, 9)] if args.small else [(0, 300), (400, 77), (1000, 130)],
        "mixed": ([(39, 1), (20, 12)] if args.small else [(699, 1), (99, 1), (500, 200)]),
    }
    print(f"max / mean |error| against float64, {args.dtype}, blocks of {args.block}")
    for shape, scale, (kind, runs) in itertools.product(
        args.shapes.split(","), map(float, args.scales.split(",")), cases.items()
    ):
        found = errors(runs, shape, args.block, scale, dtype, dev)
        print(f"{shape:5s} scale {scale:g} {kind:8s} " + "  ".join(
            f"{name} {top:.5f} / {mean:.5f}" for name, (top, mean) in found.items()
        ), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
