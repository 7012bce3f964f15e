"""Cascade decode's pieces: merging two attentions over disjoint keys, and finding the
prefix a decode batch shares."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from nanoqwen.attention.cascade import shared_prefix_blocks


def _attend(q, k, v, scale):
    """q [t, h, d], k/v [n, h, d] -> (out [t, h, d], lse [t, h]); lse -inf with no keys."""
    if k.shape[0] == 0:
        return torch.zeros_like(q), torch.full(q.shape[:2], -math.inf)
    s = torch.einsum("thd,nhd->thn", q, k) * scale
    return torch.einsum("thn,nhd->thd", s.softmax(-1), v), s.logsumexp(-1)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter")
@pytest.mark.parametrize("split", [0, 1, 37, 64])
def test_merged_parts_equal_attention_over_all_keys(split):
    from nanoqwen.kernels.triton.merge_attention import merge_attention

    gen = torch.Generator().manual_seed(split)
    t, h, d, n, scale = 5, 3, 16, 64, 0.25
    q, k, v = (torch.randn(x, h, d, generator=gen) for x in (t, n, n))
    full, _ = _attend(q, k, v, scale)
    o1, lse1 = _attend(q, k[:split], v[:split], scale)
    o2, lse2 = _attend(q, k[split:], v[split:], scale)
    if split == 0:
        lse1 = torch.full_like(lse1, math.inf)  # flash-attn's mark of an empty row
    # flash-attn's layouts: the shared part's lse comes as [heads, tokens].
    merged = merge_attention(o1, lse1.t().contiguous().t(), o2, lse2)
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)


def test_shared_prefix_blocks():
    block = 4
    tables = np.array([[7, 3, 9, 1], [7, 3, 9, 2], [7, 3, 5, 0]], dtype=np.int32)
    # Every newest token lies past column 2: columns 0-1 are shared, column 2 differs.
    assert shared_prefix_blocks(tables, np.array([13, 13, 14]), block) == 2
    # A sequence whose newest token sits in block 1 caps the prefix at one block.
    assert shared_prefix_blocks(tables, np.array([13, 8, 14]), block) == 1
    # Its newest token at position 4 (block 1's first slot): block 0 still counts.
    assert shared_prefix_blocks(tables, np.array([13, 5, 14]), block) == 1
    assert shared_prefix_blocks(tables, np.array([13, 4, 14]), block) == 0
    # All columns shared up to the shortest context.
    same = np.array([[7, 3, 9, 1], [7, 3, 9, 2]], dtype=np.int32)
    assert shared_prefix_blocks(same, np.array([13, 16]), block) == 3
    # One sequence shares nothing with anyone.
    assert shared_prefix_blocks(tables[:1], np.array([13]), block) == 0
    assert shared_prefix_blocks(np.array([[1, 2], [3, 2]]), np.array([9, 9]), block) == 0
