"""The one float32 buffer that all of an engine's CUDA graphs write their logits into.

A captured graph's output stays allocated for as long as the graph lives. With an output of
its own, each graph (a decode graph per batch size, filter stage, attention variant and
cascade; a prefill graph per bucket and logit row count; a verify graph per batch size) would
keep a [rows, vocab] float32 tensor: about 8 GiB at 0.5B with max_num_seqs 256, past what the
KV cache is sized around, enough to run an 80 GB GPU out of memory at the defaults. One
buffer, allocated before the KV cache is sized, serves them all: a step replays one graph and
queues everything that reads its logits (sampling, logprobs) before the engine launches the
next step.
"""

from __future__ import annotations

import torch


def allocate_graph_logits(rows: int, model) -> torch.Tensor:
    """rows: the most logit rows any of the graphs computes (a decode batch, the logit rows of
    a prefill graph, a verify graph's sequences times their rows each); model: the engine's
    Qwen2ForCausalLM (under tensor parallelism the logits span the whole vocabulary)."""
    vocab, device = model.full_config.vocab_size, model.embed_tokens.device
    return torch.empty(rows, vocab, dtype=torch.float32, device=device)
