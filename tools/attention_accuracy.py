"""Attention kernels against float64: the Triton decode and prefill kernels and the torch
path, on the same bfloat16 inputs (q rotated with HF's rounding, the keys as the torch path
writes them), at head shapes and input scales where softmax is flat (scale 1) or peaked
(scale 4: q and k four times larger, as in tests' tiny models of initializer_range 0.2).

Bit-level agreement between two bfloat16 kernels says little: both round. Against float64
each kernel's own error shows, and two kernels that agree by sharing an error stand out.

    python3 tools/attention_accuracy.py [--scales 1,4] [--block 16]
On a machine without a GPU, --device cpu --dtype float16 runs it in Triton's interpreter
(slowly; --small).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

import torch

# The tests' paged steps; without a GPU, importing conftest also turns Triton's interpreter
# on, before any kernel module is imported.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import paged_prefill_step  # noqa: E402

from nanoqwen.attention.rotary import RotaryEmbedding  # noqa: E402
from nanoqwen.attention.torch_backend import TorchAttention  # noqa: E402
from nanoqwen.attention.triton_backend import TritonAttention  # noqa: E402

HEADS = {"tiny": (4, 2, 64), "0.5B": (14, 2, 64), "7B": (28, 4, 128)}


def paged_step(runs, heads, kv_heads, head_dim, block, scale, dtype, dev):
    """tests/conftest.py's paged step of sequences of (cached, new) tokens, on dev, with q,
    new k and cached k at scale times a standard normal (a power of two keeps it exact)."""
    qkv, k_cache, v_cache, meta = paged_prefill_step(runs, heads, kv_heads, head_dim, block,
                                                     dtype)  # fmt: skip
    qkv[:, : (heads + kv_heads) * head_dim] *= scale / 2  # conftest draws 2 x N(0, 1)
    k_cache *= scale
    moved = {
        f.name: getattr(meta, f.name).to(dev)
        for f in dataclasses.fields(meta)
        if isinstance(getattr(meta, f.name), torch.Tensor)
    }
    meta = dataclasses.replace(meta, is_prefill=any(n > 1 for _, n in runs), **moved)
    return qkv.to(dev), k_cache.to(dev), v_cache.to(dev), meta


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
