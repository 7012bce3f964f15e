"""nanoqwen/kernels/cpu/cpu_ops.c, a bfloat16 CPU step's C kernels, against the torch ops they
replace: the residual sum, SiLU·up, RoPE with the KV write (a prefill's attention then equal)
and the int8 matmul's activations bit for bit, RMSNorm but for the odd element its sum of
squares' order rounds the other way, decode attention's KV writes bit for bit and its output
within bfloat16 rounding of a float64 reference, over block sizes, GQA groups, head sizes and
contexts that span many blocks of a shuffled table."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.attention.native_backend import NativeAttention
from nanoqwen.attention.rotary import RotaryEmbedding, apply_rotary
from nanoqwen.attention.torch_backend import TorchAttention
from nanoqwen.kernels.cpu.cpu_ops import (
    add_rms_norm,
    cpu_kernels,
    decode_attention,
    dequantize_rows,
    quantize_rows_int8,
    silu_mul,
)
from nanoqwen.model.layers import RMSNorm
from nanoqwen.quant.linear import _int8_matmul

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


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(14, 2, 64), (28, 4, 128)])
def test_a_prefill_rotates_and_writes_as_torch_and_attends_alike(heads, kv_heads, dim):
    """Two prompts, the second after 40 cached tokens of its own (a prefix-cache hit)."""
    rotary = RotaryEmbedding(dim, 4096, 1e6, "cpu")
    block_size, new, cached = 16, [70, 9], [0, 40]
    lens = [n + c for n, c in zip(new, cached)]
    qkv, k_cache, v_cache, meta = paged_inputs(lens, heads, kv_heads, dim, block_size, seed=1)
    positions = torch.cat([torch.arange(c, c + n) for n, c in zip(new, cached)])
    tables = meta.block_tables
    slots = torch.cat(
        [tables[i, positions_i // block_size].long() * block_size + positions_i % block_size
         for i, positions_i in enumerate(torch.split(positions, new))]
    )  # fmt: skip
    qkv = torch.randn(sum(new), qkv.shape[1], generator=torch.Generator().manual_seed(2)).to(BF16)
    cu = torch.tensor([0, new[0], sum(new)], dtype=torch.int32)
    meta = AttentionMetadata(
        is_prefill=True, positions=positions, slot_mapping=slots, context_lens=meta.context_lens,
        block_tables=tables, cu_seqlens_q=cu, max_seqlen_q=max(new), max_seqlen_k=max(lens),
    )  # fmt: skip
    k_torch, v_torch = k_cache.clone(), v_cache.clone()
    want = TorchAttention(rotary, dim**-0.5).forward(qkv, k_torch, v_torch, meta)
    got = NativeAttention(rotary, dim**-0.5).forward(qkv, k_cache, v_cache, meta)
    assert torch.equal(bits(k_cache), bits(k_torch)) and torch.equal(bits(v_cache), bits(v_torch))
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("with_bias", [True, False])
def test_int8_activations_are_the_torch_ops_bit_for_bit(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 896, generator=g) * 4).to(BF16)
    x[0, :] = 0  # scale from the 1e-30 floor, codes 0
    q = torch.randint(-127, 128, (1152, 896), generator=g, dtype=torch.int8)
    scale = torch.rand(1152, generator=g) * 0.01
    bias = torch.randn(1152, generator=g).to(BF16) if with_bias else None
    want = _int8_matmul(x, q, scale)
    want = want if bias is None else want + bias
    xq, x_scale = quantize_rows_int8(x)
    got = dequantize_rows(torch._int_mm(xq, q.t()), x_scale, scale, bias)
    assert torch.equal(bits(got), bits(want))
