"""The verify attention kernel compiled (kernels/triton/verify_attention.py, bfloat16 and a
float8 cache): the same rows as the prefill kernel gives for the same step, at the real
shapes and split counts."""

from __future__ import annotations

import pytest
import torch

from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.attention.rotary import RotaryEmbedding
from nanoqwen.attention.triton_backend import TritonAttention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _step(seqs: int, rows: int, contexts: list[int], heads, kv_heads, head_dim, page, kv_dtype):
    gen = torch.Generator().manual_seed(seqs * rows)
    width = max(-(-c // page) for c in contexts)
    blocks = seqs * width + 1
    tables = torch.randperm(blocks - 1, generator=gen).to(torch.int32).view(seqs, width)
    k_cache = torch.randn(blocks, page, kv_heads, head_dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(blocks, page, kv_heads, head_dim, generator=gen).to(kv_dtype)
    positions = [c - rows + j for c in contexts for j in range(rows)]
    slots = [int(tables[i, p // page]) * page + p % page
             for i, c in enumerate(contexts) for p in range(c - rows, c)]  # fmt: skip
    # A large norm makes the softmax peaked: a wrong key or mask moves the output by O(1).
    qkv = 3 * torch.randn(seqs * rows, (heads + 2 * kv_heads) * head_dim, generator=gen)
    cu_k = torch.tensor([0, *torch.tensor(contexts).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        is_prefill=True,
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        block_tables=tables,
        cu_seqlens_q=torch.arange(0, seqs * rows + 1, rows, dtype=torch.int32),
        max_seqlen_q=rows,
        max_seqlen_k=max(contexts),
        cu_seqlens_k=cu_k,
        padded=True,
    )
    cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in vars(meta).items()}
    return qkv.cuda().bfloat16(), k_cache.cuda(), v_cache.cuda(), AttentionMetadata(**cuda)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "seqs", "rows"),
    [(14, 2, 64, 1, 5), (14, 2, 64, 8, 5), (28, 4, 128, 1, 5), (28, 4, 128, 4, 17)],
    ids=["0.5B-bs1-k4", "0.5B-bs8-k4", "7B-bs1-k4", "7B-bs4-k16"],
)
def test_verify_rows_equal_the_prefill_kernels(heads, kv_heads, head_dim, seqs, rows, kv_dtype):
    contexts = [724 + 97 * i for i in range(seqs)]
    rotary = RotaryEmbedding(head_dim, 4096, 1e6, torch.device("cuda"))
    backend = TritonAttention(rotary, head_dim**-0.5, use_flash_attn=False)
    qkv, k_cache, v_cache, meta = _step(seqs, rows, contexts, heads, kv_heads, head_dim, 256,
                                        kv_dtype)  # fmt: skip
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = backend.forward(qkv.clone(), k_ref, v_ref, meta)  # the prefill kernel
    meta.uniform_q = rows
    out = backend.forward(qkv, k_cache, v_cache, meta)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
