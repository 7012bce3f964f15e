"""nanoqwen/native/cpu_decode.c, the bfloat16 CPU decode step's C kernels, against the torch
ops they replace: the residual sum and SiLU·up bit for bit, RMSNorm but for the odd element
its sum of squares' order rounds the other way, the decode attention's KV writes bit for bit
and its output within bfloat16 rounding of a float64 reference, over block sizes, GQA
groups, head sizes and contexts that span many blocks of a shuffled table."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoqwen.model.attention import AttentionMetadata
from nanoqwen.model.layers import RMSNorm, RotaryEmbedding, apply_rotary
from nanoqwen.native.cpu_decode import add_rms_norm, cpu_kernels, decode_attention, silu_mul
from nanoqwen.runtime.attention.torch_backend import TorchAttention

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C compiler here")
BF16 = torch.bfloat16


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: the rows split over threads
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_is_the_torch_norm(rows, with_residual):
    differ = 0
    for seed in range(20):
        torch.manual_seed(seed)
        norm = RMSNorm(896, 1e-6, BF16, "cpu")
        norm.weight.data.normal_()
        x = torch.randn(rows, 896, dtype=BF16) * 3
        residual = torch.randn(rows, 896, dtype=BF16) if with_residual else None
        want, want_sum = norm(x, None if residual is None else residual.clone())
        got, got_sum = add_rms_norm(x, norm.weight, norm.eps, residual)
        assert torch.equal(bits(got_sum), bits(want_sum))
        assert got_sum is (residual if with_residual else x)  # the sum is written in place
        # The sum of squares in another order: its float32 rsqrt can differ in the last bit,
        # which moves the odd element to the next bfloat16 (twice over the weight's product).
        gap = (bits(got).int() - bits(want).int()).abs()
        assert gap.max() <= 2
        differ += int((gap > 0).sum())
    assert differ <= 20 * rows * 896 // 10_000, differ


def test_silu_mul_is_torchs_for_every_bfloat16_gate():
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(BF16)
    gate = every[~every.isnan() & ~every.isinf()]
    up = torch.randn(gate.numel(), dtype=BF16)
    got = silu_mul(torch.cat([gate, up]).view(1, -1))[0]
    want = F.silu(gate) * up
    assert torch.equal(bits(got), bits(want))


def paged_inputs(lens, heads, kv_heads, dim, block_size, seed=0):
    """Caches of random keys and values, every sequence's blocks scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-n // block_size) for n in lens]
    blocks = sum(widths) + 3
    k_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=g).to(BF16)
    v_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=g).to(BF16)
    order = torch.randperm(blocks, generator=g).int()
    tables = torch.zeros(len(lens), max(widths), dtype=torch.int32)
    used = 0
    for i, w in enumerate(widths):
        tables[i, :w] = order[used : used + w]
        used += w
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.stack(
        [
            tables[i, p // block_size].long() * block_size + p % block_size
            for i, p in enumerate(positions)
        ]
    )
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * dim, generator=g).to(BF16) * 2
    meta = AttentionMetadata(
        is_prefill=False, positions=positions, slot_mapping=slots,
        context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
        cu_seqlens_q=torch.arange(len(lens) + 1, dtype=torch.int32), max_seqlen_q=1,
        max_seqlen_k=max(lens),
    )  # fmt: skip
    return qkv, k_cache, v_cache, meta


def reference(qkv, k_cache, v_cache, meta, rotary, heads, kv_heads, dim):
    """float64 attention of the rotated q over each sequence's keys (read from the cache)."""
    block_size = k_cache.shape[1]
    out = []
    for i, n in enumerate(meta.context_lens.tolist()):
        slots = [
            meta.block_tables[i, j // block_size] * block_size + j % block_size for j in range(n)
        ]
        slots = torch.tensor(slots).long()
        k = k_cache.view(-1, kv_heads, dim)[slots].double().repeat_interleave(heads // kv_heads, 1)
        v = v_cache.view(-1, kv_heads, dim)[slots].double().repeat_interleave(heads // kv_heads, 1)
        cos, sin = rotary.cos_sin(meta.positions[i : i + 1], BF16)
        q = apply_rotary(qkv[i : i + 1, : heads * dim].view(1, heads, dim), cos, sin)[0].double()
        p = (torch.einsum("hd,jhd->hj", q, k) * dim**-0.5).softmax(-1)
        out.append(torch.einsum("hj,jhd->hd", p, v))
    return torch.stack(out)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size", "lens"),
    [
        (14, 2, 64, 16, [1, 17, 100, 33]),  # 0.5B's heads, block edges
        (14, 2, 64, 256, [300, 5]),
        (28, 4, 128, 16, [129, 2]),  # 7B's heads
        (4, 4, 128, 32, [64]),  # no GQA
        (6, 2, 32, 16, [3000, 40]),  # a head size without its own specialization
    ],
)
def test_decode_attention_writes_the_cache_as_torch_and_attends_within_rounding(
    heads, kv_heads, dim, block_size, lens
):
    rotary = RotaryEmbedding(dim, 4096, 1e6, "cpu")
    qkv, k_cache, v_cache, meta = paged_inputs(lens, heads, kv_heads, dim, block_size)
    k_torch, v_torch = k_cache.clone(), v_cache.clone()
    TorchAttention(rotary, dim**-0.5).forward(qkv, k_torch, v_torch, meta)
    got = decode_attention(
        qkv, meta.positions, meta.slot_mapping, meta.context_lens, meta.block_tables,
        rotary.cos_half, rotary.sin_half, k_cache, v_cache, dim**-0.5,
    )  # fmt: skip
    assert torch.equal(bits(k_cache), bits(k_torch)) and torch.equal(bits(v_cache), bits(v_torch))
    want = reference(qkv, k_cache, v_cache, meta, rotary, heads, kv_heads, dim)
    assert got.shape == (len(lens), heads, dim)
    # float32 sums rounded once to bfloat16: within half a bfloat16 ulp, plus float32 noise.
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    assert ((got.double() - want).abs() <= 0.5 * ulp + 1e-6).all()
