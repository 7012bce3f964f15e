"""Merge two attention results over disjoint key sets into the attention over their union.

Each part comes with the log-sum-exp of its scaled scores; the union's softmax weighs the
parts by exp(lse_part - lse_union). A part over no keys has lse -inf, or +inf as flash-attn
writes it for an empty row: both count as empty.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(
    o1_ptr, o1_tok, o1_head, lse1_ptr, lse1_tok, lse1_head,
    o2_ptr, o2_tok, o2_head, lse2_ptr, lse2_tok, lse2_head,
    out_ptr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    lse1 = tl.load(lse1_ptr + tok * lse1_tok + head * lse1_head)
    lse2 = tl.load(lse2_ptr + tok * lse2_tok + head * lse2_head)
    lse1 = tl.where(lse1 == float("inf"), float("-inf"), lse1)
    lse2 = tl.where(lse2 == float("inf"), float("-inf"), lse2)
    m = tl.maximum(lse1, lse2)
    m = tl.where(m == float("-inf"), 0.0, m)  # both empty: zero weights, zero output
    w1 = tl.exp(lse1 - m)
    w2 = tl.exp(lse2 - m)
    total = w1 + w2
    total = tl.where(total == 0.0, 1.0, total)
    o1 = tl.load(o1_ptr + tok * o1_tok + head * o1_head + d).to(tl.float32)
    o2 = tl.load(o2_ptr + tok * o2_tok + head * o2_head + d).to(tl.float32)
    out = (o1 * (w1 / total) + o2 * (w2 / total)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (tok * NUM_HEADS + head) * HEAD_DIM + d, out)


def merge_attention(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """o1, o2: [tokens, heads, head_dim] (any strides, last dim contiguous); lse1, lse2:
    float32 [tokens, heads] (any strides, e.g. transposed views of flash-attn's [heads,
    tokens]). Returns [tokens, heads, head_dim] in o1's dtype."""
    tokens, heads, head_dim = o1.shape
    assert o1.stride(2) == 1 and o2.stride(2) == 1
    assert o2.shape == o1.shape and lse1.shape == lse2.shape == (tokens, heads)
    out = torch.empty(tokens, heads, head_dim, dtype=o1.dtype, device=o1.device)
    _merge_kernel[(tokens, heads)](
        o1, o1.stride(0), o1.stride(1), lse1, lse1.stride(0), lse1.stride(1),
        o2, o2.stride(0), o2.stride(1), lse2, lse2.stride(0), lse2.stride(1),
        out, NUM_HEADS=heads, HEAD_DIM=head_dim, num_warps=1,
    )  # fmt: skip
    return out
