"""The Triton attention kernels over a float8 (e4m3) KV cache, in Triton's CPU interpreter:
what they write is the rotated key and the value cast to float8 (saturating at +-448, never
NaN), and what they compute is the float16 reference's attention over the dequantized cache
within float8's rounding."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import paged_prefill_step
from test_decode_attention import _decode_step

from nanoqwen.attention.metadata import split_qkv
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
@pytest.mark.parametrize("large", [False, True], ids=["small-batch", "large-batch"])
def test_decode_writes_float8_and_attends_over_it(splits, magnitude, large, monkeypatch):
    """large: the tile and warps a float8 cache takes from LARGE_BATCH pairs up."""
    import nanoqwen.kernels.triton.decode_attention as decode

    if large:
        monkeypatch.setattr(decode, "LARGE_BATCH", 1)
    qkv, k16, v16, meta = _decode_step([1, 17, 65, 300], HEADS, KV_HEADS, HEAD_DIM, PAGE,
                                       torch.float16)  # fmt: skip
    qkv[:, HEADS * HEAD_DIM :] *= magnitude  # the new keys and values
    k8, v8 = fp8(k16), fp8(v16)
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


def test_decode_over_float8_with_wide_heads_takes_short_tiles_on_one_warp(monkeypatch):
    """7B's heads (128 wide) from LARGE_BATCH pairs up: 64 keys a tile on one warp, four
    splits, the split count and tile the launcher picks itself."""
    import nanoqwen.kernels.triton.decode_attention as decode

    monkeypatch.setattr(decode, "LARGE_BATCH", 1)
    heads, kv_heads, head_dim, page = 28, 4, 128, 64
    lengths = [1, 17, 65, 300]
    assert decode.tile_config(len(lengths), kv_heads, head_dim, True, page) == (64, 1)
    assert decode.num_splits_for(len(lengths), kv_heads, head_dim, fp8=True) == 4
    qkv, k16, v16, meta = _decode_step(lengths, heads, kv_heads, head_dim, page, torch.float16)
    k8, v8 = fp8(k16), fp8(v16)
    rotary = RotaryEmbedding(head_dim, 1024, 1e6, "cpu")
    ref, k_ref, v_ref = reference(qkv, k8, v8, meta, rotary)
    out = decode_attention(
        qkv, meta.positions, meta.slot_mapping, meta.context_lens, meta.block_tables,
        rotary.cos_half, rotary.sin_half, k8, v8, 0.125,
    )  # fmt: skip
    check(out, ref, k8, v8, k_ref, v_ref)


def test_prefill_writes_float8_and_attends_over_it():
    runs = [(0, 5), (30, 9), (100, 3)]  # (cached tokens, new tokens)
    qkv, k16, v16, meta = paged_prefill_step(runs, HEADS, KV_HEADS, HEAD_DIM, PAGE, torch.float16)
    qkv = (qkv / 2).half()  # paged_prefill_step's keys are doubled: back to float8's finer range
    k8, v8 = fp8(k16), fp8(v16)
    rotary = RotaryEmbedding(HEAD_DIM, 1024, 1e6, "cpu")
    ref, k_ref, v_ref = reference(qkv, k8, v8, meta, rotary)
    out = TritonAttention(rotary, 0.125, use_flash_attn=False).forward(qkv, k8, v8, meta)
    check(out, ref, k8, v8, k_ref, v_ref)
