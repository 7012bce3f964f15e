"""The verify attention kernel compiled (kernels/triton/verify_attention.py, bfloat16 and a
float8 cache): the same rows as the prefill kernel gives for the same step, at the real
shapes and split counts."""

from __future__ import annotations

import pytest
import torch
from conftest import paged_prefill_step

from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.attention.rotary import RotaryEmbedding
from nanoqwen.attention.triton_backend import TritonAttention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _step(rows: int, contexts: list[int], heads, kv_heads, head_dim, page, kv_dtype):
    """test_prefill_attention's step (each sequence's last `rows` tokens new), on the GPU:
    q/k/v in bfloat16, the caches in kv_dtype, laid out as the verify graphs pad it."""
    runs = [(c - rows, rows) for c in contexts]
    qkv, k_cache, v_cache, meta = paged_prefill_step(runs, heads, kv_heads, head_dim, page,
                                                torch.float32)  # fmt: skip
    meta.padded = True
    cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in vars(meta).items()}
    caches = (c.cuda().to(kv_dtype) for c in (k_cache, v_cache))
    return qkv.cuda().bfloat16(), *caches, AttentionMetadata(**cuda)


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
    qkv, k_cache, v_cache, meta = _step(rows, contexts, heads, kv_heads, head_dim, 256, kv_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = backend.forward(qkv.clone(), k_ref, v_ref, meta)  # the prefill kernel
    meta.uniform_q = rows
    out = backend.forward(qkv, k_cache, v_cache, meta)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
