"""Cascade decode (attention/cascade.py) on the GPU: attention over a prefix every
sequence shares plus each one's own keys equals attention over the whole context."""

from __future__ import annotations

import pytest
import torch

from nanoqwen.attention.cascade import cascade_decode
from nanoqwen.attention.metadata import AttentionMetadata

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 64), (28, 4, 128)])
def test_cascade_equals_attention_over_the_whole_context(heads, kv_heads, head_dim):
    flash_attn = pytest.importorskip("flash_attn")
    gen = torch.Generator(device="cuda").manual_seed(0)
    bs, page, shared = 48, 256, 3
    own = [1 + 37 * i % 300 for i in range(bs)]  # each sequence's keys after the prefix
    own_blocks = [-(-n // page) for n in own]
    width = shared + max(own_blocks)
    tables = torch.zeros(bs, width, dtype=torch.int32)
    suffix = torch.zeros(bs, width, dtype=torch.int32)
    next_block = shared
    for i, b in enumerate(own_blocks):
        mine = torch.arange(next_block, next_block + b, dtype=torch.int32)
        tables[i, :shared] = torch.arange(shared, dtype=torch.int32)
        tables[i, shared : shared + b] = mine
        suffix[i, :b] = mine
        next_block += b
    shape = (next_block, page, kv_heads, head_dim)
    dev = dict(device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(shape, generator=gen, **dev)
    v_cache = torch.randn(shape, generator=gen, **dev)
    q = torch.randn(bs, heads, head_dim, generator=gen, **dev)
    lens = torch.tensor([shared * page + n for n in own], dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    meta = AttentionMetadata(
        is_prefill=False, positions=lens.long() - 1, slot_mapping=lens.long() * 0,
        context_lens=lens, block_tables=tables.cuda(), cu_seqlens_q=lens * 0, max_seqlen_q=1,
        max_seqlen_k=int(lens.max()),
        prefix_len=torch.tensor([shared * page], dtype=torch.int32, device="cuda"),
        suffix_tables=suffix.cuda(), suffix_lens=lens - shared * page,
    )  # fmt: skip
    cascade = cascade_decode(q, k_cache, v_cache, meta, scale).float()
    plain = flash_attn.flash_attn_with_kvcache(
        q.unsqueeze(1), k_cache, v_cache, cache_seqlens=lens, block_table=meta.block_tables,
        softmax_scale=scale,
    )[:, 0].float()  # fmt: skip
    # float32 reference, sequence by sequence over its whole context.
    ref = torch.empty_like(cascade)
    group = heads // kv_heads
    for i in range(bs):
        n = int(lens[i])
        blocks = tables[i, : -(-n // page)].long().cuda()
        k = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:n].float()
        v = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:n].float()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        ref[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    plain_err = (plain - ref).abs().max().item()
    cascade_err = (cascade - ref).abs().max().item()
    # Both round the output to bf16 once (about 0.004 at these magnitudes).
    assert cascade_err <= max(2 * plain_err, 0.008), (cascade_err, plain_err)
