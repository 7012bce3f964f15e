"""Logits written into a caller's buffer (the CUDA graphs' shared output,
runtime/graph_logits.py) are the logits compute_logits returns otherwise."""

from __future__ import annotations

import pytest
import torch

from nanoqwen import LLM


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_into_a_given_buffer_equal_the_returned_ones(tiny_model, dtype):
    path, _ = tiny_model
    llm = LLM(str(path), device="cpu", dtype=dtype, progress=False)
    net = llm.runner.model
    hidden, vocab = net.config.hidden_size, net.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, hidden, generator=gen).to(net.embed_tokens.dtype)
    residual = torch.randn(3, hidden, generator=gen).to(net.embed_tokens.dtype)
    # clones: the add+norm may sum into the residual in place
    want = net.compute_logits((x.clone(), residual.clone()))
    buf = torch.full((5, vocab), 7.0)
    got = net.compute_logits((x.clone(), residual.clone()), out=buf[:3])
    assert got.data_ptr() == buf.data_ptr()
    assert want.dtype == torch.float32
    assert torch.equal(buf[:3], want)
    assert torch.equal(buf[3:], torch.full((2, vocab), 7.0))
