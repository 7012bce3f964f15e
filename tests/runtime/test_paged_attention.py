"""The torch backend's paged attention equals plain causal attention over contiguous K/V.

Sequences of context lengths around block boundaries share one batch, their blocks drawn
from a shuffled pool, so any mix-up of block tables, offsets, masks or GQA head mapping
shows up as a numeric difference against a float64 reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.attention.rotary import RotaryEmbedding
from nanoqwen.attention.torch_backend import TorchAttention, paged_attention, store_kv

BLOCK_SIZE = 8
HEAD_DIM = 16
ROPE_BASE = 10000.0
# Context lengths: 1, bs-1, bs, bs+1 and several blocks (plus a partial one).
CONTEXT_LENS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 4 * BLOCK_SIZE + 3, 3 * BLOCK_SIZE]
GQA = [(4, 4), (4, 2), (6, 1)]  # (query heads, kv heads): ratios 1, 2, 6
TOL = dict(atol=1e-5, rtol=1e-5)


def reference_attention(q, k, v, q_positions, scale):
    """q: [n, H, D] at q_positions; k, v: [ctx, KVH, D] for positions 0..ctx-1.
    Causal softmax attention in float64, each KV head shared by H / KVH query heads."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    keys = torch.arange(k.shape[0])
    mask = keys.view(1, 1, -1) > q_positions.view(1, -1, 1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def reference_rope(x, positions):
    """HF's non-interleaved RoPE in float64: x [n, heads, D] at positions [n]."""
    x = x.double()
    dim = x.shape[-1]
    inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = positions.double().view(-1, 1) * inv_freq.view(1, -1)
    cos = torch.cat((angles.cos(), angles.cos()), -1).unsqueeze(1)
    sin = torch.cat((angles.sin(), angles.sin()), -1).unsqueeze(1)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


class Pool:
    """A KV pool whose blocks are handed to sequences in a random order."""

    def __init__(self, context_lens, kv_heads, seed):
        self.gen = torch.Generator().manual_seed(seed)
        need = [math.ceil(c / BLOCK_SIZE) for c in context_lens]
        # Spare blocks that nobody owns, plus the scratch block past the end.
        self.num_blocks = sum(need) + 5
        order = torch.randperm(self.num_blocks, generator=self.gen).tolist()
        self.tables, start = [], 0
        for n in need:
            self.tables.append(order[start : start + n])
            start += n
        shape = (self.num_blocks + 1, BLOCK_SIZE, kv_heads, HEAD_DIM)
        # Garbage everywhere: only slots inside a context may influence the result.
        self.k_cache = torch.randn(shape, generator=self.gen) * 50
        self.v_cache = torch.randn(shape, generator=self.gen) * 50

    @property
    def scratch(self):
        return self.num_blocks

    def slots(self, i, start, end):
        table = self.tables[i]
        return [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]

    def block_tables(self):
        width = max(len(t) for t in self.tables)
        rows = [t + [self.scratch] * (width - len(t)) for t in self.tables]
        return torch.tensor(rows, dtype=torch.int32)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen)


def decode_meta(pool, context_lens):
    n = len(context_lens)
    slots = [pool.slots(i, c - 1, c)[0] for i, c in enumerate(context_lens)]
    return AttentionMetadata(
        is_prefill=False,
        positions=torch.tensor([c - 1 for c in context_lens], dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=pool.block_tables(),
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
        max_seqlen_q=1,
        max_seqlen_k=max(context_lens),
    )


def prefill_meta(pool, context_lens, query_lens):
    positions, slots, cu_q, cu_k = [], [], [0], [0]
    for i, (c, n) in enumerate(zip(context_lens, query_lens)):
        positions += range(c - n, c)
        slots += pool.slots(i, c - n, c)
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + c)
    return AttentionMetadata(
        is_prefill=True,
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=pool.block_tables(),
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
        max_seqlen_q=max(query_lens),
        max_seqlen_k=max(context_lens),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
    )


def query_lens_for(context_lens):
    """Query chunks at the end of each context: the whole context, one token, a chunk that
    starts mid-block, one that starts on a block boundary."""
    choices = []
    for i, c in enumerate(context_lens):
        options = [c, 1, max(1, c // 2 + 1), max(1, c - (c - 1) // BLOCK_SIZE * BLOCK_SIZE)]
        choices.append(options[i % len(options)])
    return choices


def fill_context(pool, i, k, v):
    """Writes K/V of sequence i's positions 0..len(k)-1 through store_kv."""
    slots = torch.tensor(pool.slots(i, 0, k.shape[0]), dtype=torch.int64)
    store_kv(k, v, pool.k_cache, pool.v_cache, slots)


@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
def test_store_kv_writes_each_token_to_its_slot(heads, kv_heads):
    pool = Pool(CONTEXT_LENS, kv_heads, seed=0)
    before_k, before_v = pool.k_cache.clone(), pool.v_cache.clone()
    written = set()
    for i, c in enumerate(CONTEXT_LENS):
        k, v = pool.randn(c, kv_heads, HEAD_DIM), pool.randn(c, kv_heads, HEAD_DIM)
        fill_context(pool, i, k, v)
        for p in range(c):
            block, offset = pool.tables[i][p // BLOCK_SIZE], p % BLOCK_SIZE
            assert torch.equal(pool.k_cache[block, offset], k[p])
            assert torch.equal(pool.v_cache[block, offset], v[p])
            written.add((block, offset))
    for block in range(pool.num_blocks + 1):
        for offset in range(BLOCK_SIZE):
            if (block, offset) not in written:
                assert torch.equal(pool.k_cache[block, offset], before_k[block, offset])
                assert torch.equal(pool.v_cache[block, offset], before_v[block, offset])


@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
def test_paged_decode_matches_contiguous(heads, kv_heads):
    pool = Pool(CONTEXT_LENS, kv_heads, seed=1)
    scale = HEAD_DIM**-0.5
    ks, vs = [], []
    for i, c in enumerate(CONTEXT_LENS):
        ks.append(pool.randn(c, kv_heads, HEAD_DIM))
        vs.append(pool.randn(c, kv_heads, HEAD_DIM))
        fill_context(pool, i, ks[-1], vs[-1])
    q = pool.randn(len(CONTEXT_LENS), heads, HEAD_DIM)
    out = paged_attention(q, pool.k_cache, pool.v_cache, decode_meta(pool, CONTEXT_LENS), scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    for i, c in enumerate(CONTEXT_LENS):
        ref = reference_attention(q[i : i + 1], ks[i], vs[i], torch.tensor([c - 1]), scale)
        torch.testing.assert_close(out[i : i + 1].double(), ref, **TOL)


@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
def test_paged_prefill_with_cached_context_matches_contiguous(heads, kv_heads):
    pool = Pool(CONTEXT_LENS, kv_heads, seed=2)
    query_lens = query_lens_for(CONTEXT_LENS)
    # Both a fresh prompt and chunks over a cached context, so cu_seqlens_q != cu_seqlens_k.
    assert any(n == c for n, c in zip(query_lens, CONTEXT_LENS))
    assert any(n < c for n, c in zip(query_lens, CONTEXT_LENS))
    scale = 0.3
    ks, vs, qs = [], [], []
    for i, (c, n) in enumerate(zip(CONTEXT_LENS, query_lens)):
        ks.append(pool.randn(c, kv_heads, HEAD_DIM))
        vs.append(pool.randn(c, kv_heads, HEAD_DIM))
        qs.append(pool.randn(n, heads, HEAD_DIM))
        fill_context(pool, i, ks[-1], vs[-1])
    meta = prefill_meta(pool, CONTEXT_LENS, query_lens)
    q = torch.cat(qs)
    out = paged_attention(q, pool.k_cache, pool.v_cache, meta, scale)
    starts = meta.cu_seqlens_q.tolist()
    for i, (c, n) in enumerate(zip(CONTEXT_LENS, query_lens)):
        ref = reference_attention(qs[i], ks[i], vs[i], torch.arange(c - n, c), scale)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), ref, **TOL)


def _backend_step(heads, kv_heads, seed, is_prefill):
    """Runs TorchAttention.forward for one step (pre-RoPE q/k/v of the step's tokens, the
    earlier context already in the cache) and returns (out, reference, pool, step k, v)."""
    pool = Pool(CONTEXT_LENS, kv_heads, seed=seed)
    query_lens = query_lens_for(CONTEXT_LENS) if is_prefill else [1] * len(CONTEXT_LENS)
    rotary = RotaryEmbedding(HEAD_DIM, 64, ROPE_BASE, "cpu")
    backend = TorchAttention(rotary, HEAD_DIM**-0.5)
    k_raw, v_all, q_steps = [], [], []
    for i, (c, n) in enumerate(zip(CONTEXT_LENS, query_lens)):
        k_raw.append(pool.randn(c, kv_heads, HEAD_DIM))
        v_all.append(pool.randn(c, kv_heads, HEAD_DIM))
        q_steps.append(pool.randn(n, heads, HEAD_DIM))
        cached = c - n
        if cached:
            k_cached = reference_rope(k_raw[i][:cached], torch.arange(cached)).float()
            fill_context(pool, i, k_cached, v_all[i][:cached])
    if is_prefill:
        meta = prefill_meta(pool, CONTEXT_LENS, query_lens)
    else:
        meta = decode_meta(pool, CONTEXT_LENS)
    k_step = torch.cat([k[c - n :] for k, c, n in zip(k_raw, CONTEXT_LENS, query_lens)])
    v_step = torch.cat([v[c - n :] for v, c, n in zip(v_all, CONTEXT_LENS, query_lens)])
    tokens = k_step.shape[0]
    qkv = torch.cat([torch.cat(q_steps), k_step, v_step], 1).view(tokens, -1)
    out = backend.forward(qkv, pool.k_cache, pool.v_cache, meta)
    refs = []
    for i, (c, n) in enumerate(zip(CONTEXT_LENS, query_lens)):
        positions = torch.arange(c - n, c)
        q = reference_rope(q_steps[i], positions)
        k = reference_rope(k_raw[i], torch.arange(c))
        refs.append(reference_attention(q, k, v_all[i], positions, HEAD_DIM**-0.5))
    return out, torch.cat(refs), pool, query_lens, k_raw, v_all


@pytest.mark.parametrize("is_prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
def test_torch_backend_applies_rope_stores_and_attends(heads, kv_heads, is_prefill):
    out, ref, pool, query_lens, k_raw, v_all = _backend_step(heads, kv_heads, 3, is_prefill)
    torch.testing.assert_close(out.double(), ref, **TOL)
    # The step's own K (with RoPE) and V landed in the sequence's slots.
    for i, (c, n) in enumerate(zip(CONTEXT_LENS, query_lens)):
        slots = torch.tensor(pool.slots(i, c - n, c))
        k_flat = pool.k_cache.view(-1, kv_heads, HEAD_DIM)[slots]
        v_flat = pool.v_cache.view(-1, kv_heads, HEAD_DIM)[slots]
        expected_k = reference_rope(k_raw[i][c - n :], torch.arange(c - n, c))
        torch.testing.assert_close(k_flat.double(), expected_k, **TOL)
        assert torch.equal(v_flat, v_all[i][c - n :])


def test_result_does_not_depend_on_block_placement():
    """The same contexts in two different shuffles give the same attention output."""
    outs = []
    for seed in (4, 5):
        pool = Pool(CONTEXT_LENS, 2, seed=seed)
        gen = torch.Generator().manual_seed(99)
        ks = [torch.randn(c, 2, HEAD_DIM, generator=gen) for c in CONTEXT_LENS]
        vs = [torch.randn(c, 2, HEAD_DIM, generator=gen) for c in CONTEXT_LENS]
        q = torch.randn(len(CONTEXT_LENS), 4, HEAD_DIM, generator=gen)
        for i in range(len(CONTEXT_LENS)):
            fill_context(pool, i, ks[i], vs[i])
        meta = decode_meta(pool, CONTEXT_LENS)
        outs.append(paged_attention(q, pool.k_cache, pool.v_cache, meta, 0.25))
    assert pool.tables != Pool(CONTEXT_LENS, 2, seed=4).tables
    torch.testing.assert_close(outs[0], outs[1], **TOL)
