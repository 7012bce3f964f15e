"""The Triton decode-attention kernel against the torch reference backend.

On CPU the kernel runs in Triton's interpreter (tests/conftest.py), in float32 and float16;
tests/gpu runs it compiled, in bfloat16.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import shuffled_paged_cache

from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.attention.rotary import RotaryEmbedding
from nanoqwen.attention.torch_backend import TorchAttention

pytest.importorskip("triton")
# With a GPU the kernels compile for it and cannot take these CPU tensors; tests/gpu covers
# them there (backend agreement, graph replay, fidelity with HF).
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter"
)
import nanoqwen.kernels.triton.counters as counters  # noqa: E402
from nanoqwen.kernels.triton.decode_attention import decode_attention  # noqa: E402


def _decode_step(lengths, heads, kv_heads, head_dim, page, dtype, seed=0):
    """A decode step for sequences whose contexts (new token included) have these lengths,
    over shuffled blocks; returns everything both backends need."""
    gen = torch.Generator().manual_seed(seed)
    tables, k_cache, v_cache = shuffled_paged_cache(lengths, page, kv_heads, head_dim, dtype, gen)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(len(lengths), width, generator=gen).to(dtype)
    pos = torch.tensor([n - 1 for n in lengths])
    slots = torch.tensor([int(tables[i, (n - 1) // page]) * page + (n - 1) % page
                          for i, n in enumerate(lengths)])  # fmt: skip
    ctx = torch.tensor(lengths, dtype=torch.int32)
    meta = AttentionMetadata(
        is_prefill=False,
        positions=pos,
        slot_mapping=slots,
        context_lens=ctx,
        block_tables=tables,
        cu_seqlens_q=torch.arange(len(lengths) + 1, dtype=torch.int32),
        max_seqlen_q=1,
        max_seqlen_k=max(lengths),
    )
    return qkv, k_cache, v_cache, meta


# The 0.5B and 7B attention shapes, for the tests of one kernel option each.
real_head_shapes = pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page"),
    [(14, 2, 64, 256), (28, 4, 128, 16)],
    ids=["0.5B-heads", "7B-heads"],
)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page"),
    [(14, 2, 64, 256), (7, 1, 64, 16), (28, 4, 128, 16), (8, 8, 128, 256)],
    ids=["0.5B-heads", "group7-page16", "7B-heads", "no-gqa"],
)
@pytest.mark.parametrize("splits", [1, 3, 0], ids=["1-split", "3-splits", "auto-splits"])
def test_matches_torch_backend_and_writes_the_new_kv(heads, kv_heads, head_dim, page, splits):
    _check_against_torch(heads, kv_heads, head_dim, page, splits)


@real_head_shapes
@pytest.mark.parametrize("splits", [1, 0], ids=["1-split", "auto-splits"])
def test_large_batch_tiles_match_torch_backend(
    heads, kv_heads, head_dim, page, splits, monkeypatch
):
    """The 128-key tiles that batches from LARGE_BATCH (sequence, KV head) pairs take, here
    at a small batch."""
    import nanoqwen.kernels.triton.decode_attention as decode

    monkeypatch.setattr(decode, "LARGE_BATCH", 1)
    _check_against_torch(heads, kv_heads, head_dim, page, splits)


@real_head_shapes
@pytest.mark.parametrize("splits", [1, 4, 6], ids=["1-split", "4-splits", "6-splits"])
def test_longest_first_launch_order_matches_torch_backend(heads, kv_heads, head_dim, page, splits):
    """Sequences launched longest context first (the order the decode graphs pass); with 4
    or 6 splits the short contexts use fewer (one for a context of 1)."""
    _check_against_torch(heads, kv_heads, head_dim, page, splits, ordered=True)


@real_head_shapes
@pytest.mark.parametrize("chunk", [1, 4, 8])
def test_the_merge_reads_its_splits_in_chunks(heads, kv_heads, head_dim, page, chunk, monkeypatch):
    """12 splits merged 1, 4 or 8 at a time: a context of 1,500 uses all 12 (the last chunk
    of 8 partly past them), shorter ones fewer than a chunk holds."""
    import nanoqwen.kernels.triton.decode_attention as decode

    monkeypatch.setattr(decode, "merge_chunk", lambda *args: chunk)
    _check_against_torch(heads, kv_heads, head_dim, page, 12, lengths=[1, 300, 700, 1500])


def _check_against_torch(heads, kv_heads, head_dim, page, splits, ordered=False, lengths=None):
    # Contexts of 1 (the new token alone), across tile and page edges, and several pages.
    lengths = lengths or [1, 2, 16, 17, 64, 65, 257, 700]
    qkv, k_cache, v_cache, meta = _decode_step(
        lengths, heads, kv_heads, head_dim, page, torch.float32
    )
    rotary = RotaryEmbedding(head_dim, 2048, 1e6, "cpu")
    scale = head_dim**-0.5
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = TorchAttention(rotary, scale).forward(qkv.clone(), k_ref, v_ref, meta)
    out = decode_attention(
        qkv, meta.positions, meta.slot_mapping, meta.context_lens, meta.block_tables,
        rotary.cos_half, rotary.sin_half, k_cache, v_cache, scale, num_splits=splits,
        order=meta.context_lens.argsort(descending=True) if ordered else None,
    )  # fmt: skip
    assert out.shape == (len(lengths), heads, head_dim)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # The last split to finish merged, and left the split counters zero for the next launch.
    assert not any(c.any() for c in counters._MADE.get((out.device, "decode attention splits"), []))
    # The new keys (rotated) and values landed in their slots; nothing else changed.
    torch.testing.assert_close(k_cache, k_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(v_cache, v_ref)


def test_float16_rounds_like_the_torch_path():
    lengths = [1, 130, 300]
    qkv, k_cache, v_cache, meta = _decode_step(lengths, 14, 2, 64, 256, torch.float16)
    rotary = RotaryEmbedding(64, 1024, 1e6, "cpu")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = TorchAttention(rotary, 0.125).forward(qkv.clone(), k_ref, v_ref, meta)
    out = decode_attention(
        qkv, meta.positions, meta.slot_mapping, meta.context_lens, meta.block_tables,
        rotary.cos_half, rotary.sin_half, k_cache, v_cache, 0.125, num_splits=4,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=2e-3)
    # RoPE rounds after every op as HF does: the cached keys are bit-identical.
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("config", ["small", "large", "xl"])
def test_slots_past_the_context_are_never_trusted(config, monkeypatch):
    """A tile is copied whole from its block, so it reads slots past the context: ones never
    written, or left by an earlier request. NaN there must not reach the output (a masked
    score alone would not do: 0 * NaN is NaN in the second dot)."""
    import nanoqwen.kernels.triton.decode_attention as decode

    if config != "small":
        monkeypatch.setattr(decode, "LARGE_BATCH", 1)
    if config == "xl":
        monkeypatch.setattr(decode, "XL_BATCH", 1)
    lengths = [1, 2, 65, 130, 257, 700]
    qkv, k_cache, v_cache, meta = _decode_step(lengths, 14, 2, 64, 256, torch.float32)
    rotary = RotaryEmbedding(64, 1024, 1e6, "cpu")
    ref = TorchAttention(rotary, 0.125).forward(qkv.clone(), k_cache.clone(), v_cache.clone(), meta)
    live = torch.zeros(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool)
    for row, n in enumerate(lengths):
        at = torch.arange(n)
        live[meta.block_tables[row, at // 256].long() * 256 + at % 256] = True
    k_cache.view(-1, 2, 64)[~live] = float("nan")
    v_cache.view(-1, 2, 64)[~live] = float("nan")
    out = decode_attention(
        qkv, meta.positions, meta.slot_mapping, meta.context_lens, meta.block_tables,
        rotary.cos_half, rotary.sin_half, k_cache, v_cache, 0.125, num_splits=2,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
