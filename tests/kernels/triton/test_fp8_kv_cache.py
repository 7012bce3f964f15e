"""The Triton attention kernels over a float8 (e4m3) KV cache, in Triton's CPU interpreter:
what they write is the rotated key and the value cast to float8 (saturating at +-448, never
NaN), and what they compute is the float16 reference's attention over the dequantized cache
within float8's rounding."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import shuffled_paged_cache

from nanoqwen.attention.metadata import AttentionMetadata, split_qkv
from nanoqwen.attention.rotary import RotaryEmbedding, apply_rotary
from nanoqwen.attention.torch_backend import TorchAttention, paged_attention

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter"
)
from nanoqwen.attention.triton_backend import TritonAttention  # noqa: E402
from nanoqwen.kernels.triton.decode_attention import decode_attention  # noqa: E402

FP8 = torch.float8_e4m3fn
HEADS, KV_HEADS, HEAD_DIM, PAGE = 14, 2, 64, 16


def fp8(t: torch.Tensor) -> torch.Tensor:
    return t.float().clamp(-448, 448).to(FP8)


def caches(lengths, gen):
    tables, k, v = shuffled_paged_cache(lengths, PAGE, KV_HEADS, HEAD_DIM, torch.float16, gen)
    return tables, fp8(k), fp8(v)


def reference(qkv, k8, v8, meta, rotary):
    """The torch backend's step in float16 over the dequantized cache, with the new keys and
    values cast to float8 and back before attending, as the kernels read them: (output,
    float16 caches after the step)."""
    k16, v16 = k8.half(), v8.half()
    TorchAttention(rotary, 0.125).forward(qkv.clone(), k16, v16, meta)  # stores the new K/V
    q, _, _ = split_qkv(qkv.clone(), k16)
    cos, sin = rotary.cos_sin(meta.positions, q.dtype)
    out = paged_attention(apply_rotary(q, cos, sin), fp8(k16).half(), fp8(v16).half(), meta, 0.125)
    return out, k16, v16


def check(out, ref, k8, v8, k16, v16):
    """out is ref up to float16 rounding; the float8 caches are ref's caches cast."""
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=4e-3)
    assert torch.equal(k8.view(torch.uint8), fp8(k16).view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), fp8(v16).view(torch.uint8))


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("magnitude", [1.0, 1000.0], ids=["in-range", "saturating"])
def test_decode_writes_float8_and_attends_over_it(splits, magnitude):
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 17, 65, 300]
    tables, k8, v8 = caches(lengths, gen)
    qkv = torch.randn(len(lengths), (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)
    qkv[:, HEADS * HEAD_DIM :] *= magnitude  # the new keys and values
    qkv = qkv.half()
    meta = AttentionMetadata(
        is_prefill=False,
        positions=torch.tensor([n - 1 for n in lengths]),
        slot_mapping=torch.tensor(
            [int(tables[i, (n - 1) // PAGE]) * PAGE + (n - 1) % PAGE for i, n in enumerate(lengths)]
        ),  # fmt: skip
        context_lens=torch.tensor(lengths, dtype=torch.int32),
        block_tables=tables,
        cu_seqlens_q=torch.arange(len(lengths) + 1, dtype=torch.int32),
        max_seqlen_q=1,
        max_seqlen_k=max(lengths),
    )
    rotary = RotaryEmbedding(HEAD_DIM, 1024, 1e6, "cpu")
    ref, k_ref, v_ref = reference(qkv, k8, v8, meta, rotary)
    out = decode_attention(
        qkv, meta.positions, meta.slot_mapping, meta.context_lens, meta.block_tables,
        rotary.cos_half, rotary.sin_half, k8, v8, 0.125, num_splits=splits,
    )  # fmt: skip
    if magnitude == 1.0:
        check(out, ref, k8, v8, k_ref, v_ref)
    else:  # the new keys and values saturate; attention still gives finite numbers
        assert torch.isfinite(out).all()
        assert torch.equal(k8.view(torch.uint8), fp8(k_ref).view(torch.uint8))
        assert k8.float().abs().max() == 448


def test_prefill_writes_float8_and_attends_over_it():
    gen = torch.Generator().manual_seed(1)
    runs = [(0, 5), (30, 9), (100, 3)]  # (cached tokens, new tokens)
    lengths = [c + n for c, n in runs]
    tables, k8, v8 = caches(lengths, gen)
    positions = [p for c, n in runs for p in range(c, c + n)]
    seq_of = [i for i, (_, n) in enumerate(runs) for _ in range(n)]
    cu_q, cu_k = [0], [0]
    for (_, n), total in zip(runs, lengths):
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + total)
    meta = AttentionMetadata(
        is_prefill=True,
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(
            [int(tables[i, p // PAGE]) * PAGE + p % PAGE for i, p in zip(seq_of, positions)]
        ),  # fmt: skip
        context_lens=torch.tensor(lengths, dtype=torch.int32),
        block_tables=tables,
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
        max_seqlen_q=max(n for _, n in runs),
        max_seqlen_k=max(lengths),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
    )
    qkv = torch.randn(len(positions), (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).half()
    rotary = RotaryEmbedding(HEAD_DIM, 1024, 1e6, "cpu")
    ref, k_ref, v_ref = reference(qkv, k8, v8, meta, rotary)
    out = TritonAttention(rotary, 0.125, use_flash_attn=False).forward(qkv, k8, v8, meta)
    check(out, ref, k8, v8, k_ref, v_ref)
