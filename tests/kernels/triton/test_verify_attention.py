"""The Triton verify attention (rope_and_store, then kernels/triton/verify_attention.py, for
steps whose sequences all have the same few new rows) against the torch reference backend
on the same step laid out as a prefill. On CPU the kernels run in Triton's interpreter
(tests/conftest.py); tests/gpu runs them compiled through the verify graphs."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import paged_prefill_step

from nanoqwen.attention.rotary import RotaryEmbedding
from nanoqwen.attention.torch_backend import TorchAttention

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter"
)
import nanoqwen.kernels.triton.verify_attention as va  # noqa: E402
from nanoqwen.attention.triton_backend import TritonAttention  # noqa: E402


def _both(runs, heads, kv_heads, head_dim, page, dtype=torch.float32, seed=0):
    qkv, k_cache, v_cache, meta = paged_prefill_step(runs, heads, kv_heads, head_dim, page, dtype,
                                                seed)  # fmt: skip
    rotary = RotaryEmbedding(head_dim, 1024, 1e6, "cpu")
    scale = head_dim**-0.5
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = TorchAttention(rotary, scale).forward(qkv.clone(), k_ref, v_ref, meta)
    meta.uniform_q = runs[0][1]
    meta.shared.clear()
    backend = TritonAttention(rotary, scale, use_flash_attn=False)
    out = backend.forward(qkv, k_cache, v_cache, meta)
    return out, ref, (k_cache, v_cache), (k_ref, v_ref)


@pytest.mark.parametrize("splits", [1, 3, 16], ids=["one-split", "3-splits", "16-splits"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page", "runs"),
    [
        # 0.5B heads, k = 4: contexts shorter than a tile, tile-aligned and not.
        (14, 2, 64, 16, [(0, 5), (59, 5), (123, 5), (64, 5)]),
        # 7B heads (group 7, head_dim 128), k = 2 over blocks of 32.
        (28, 4, 128, 32, [(40, 3), (200, 3)]),
        # No GQA, k = 16 (17 rows), one sequence.
        (4, 4, 64, 16, [(150, 17)]),
    ],
    ids=["0.5B-k4", "7B-k2", "mha-k16"],
)
def test_matches_the_prefill_layout_of_the_same_step(heads, kv_heads, head_dim, page, runs,
                                                     splits, monkeypatch):  # fmt: skip
    """Every split count, with splits that hold only keys some rows may not see yet (the
    new rows' own keys at the end of the context)."""
    monkeypatch.setattr(va, "num_splits_for", lambda seqs, kv: splits)
    out, ref, cache, cache_ref = _both(runs, heads, kv_heads, head_dim, page)
    assert out.shape == ref.shape == (sum(n for _, n in runs), heads, head_dim)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[0], cache_ref[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(cache[1], cache_ref[1])


def test_float16_rows_are_within_float16_resolution():
    out, ref, _, _ = _both([(33, 5), (90, 5)], 6, 2, 64, 16, torch.float16, seed=4)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=4e-3)
