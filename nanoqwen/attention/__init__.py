"""Attention over the paged KV cache: what the model hands a backend (metadata.py), RoPE
(rotary.py), and the backends, one per kernel family (backends.py chooses)."""
