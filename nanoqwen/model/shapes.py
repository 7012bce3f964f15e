"""Real Qwen2.5 shapes, for random-weight benchmarks where checkpoints cannot travel."""

from __future__ import annotations

import torch

from nanoqwen.model.config import ModelConfig
from nanoqwen.validation import choice

# size: (hidden, intermediate, layers, heads, kv_heads, vocab, tied, rms_norm_eps)
_SHAPES = {
    "0.5B": (896, 4864, 24, 14, 2, 151936, True, 1e-6),
    "1.5B": (1536, 8960, 28, 12, 2, 151936, True, 1e-6),
    "3B": (2048, 11008, 36, 16, 2, 151936, True, 1e-6),
    "7B": (3584, 18944, 28, 28, 4, 152064, False, 1e-6),
    "14B": (5120, 13824, 48, 40, 8, 152064, False, 1e-5),
    "32B": (5120, 27648, 64, 40, 8, 152064, False, 1e-5),
    "72B": (8192, 29568, 80, 64, 8, 152064, False, 1e-5),
}
SHAPES = tuple(_SHAPES)


def shape_config(name: str) -> ModelConfig:
    choice("shape", name, SHAPES)
    hidden, inter, layers, heads, kv_heads, vocab, tied, eps = _SHAPES[name]
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        rms_norm_eps=eps,
        rope_theta=1e6,
        max_position_embeddings=32768,
        tie_word_embeddings=tied,
        eos_token_id=(151643,),
    )


@torch.no_grad()
def fill_random(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights scaled like a trained model's (so activations stay finite in bf16)."""
    device = next(model.parameters()).device
    # Drawn where the weights live: a 7B fill on the CPU would take a minute.
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "norm.weight":
            p.fill_(1.0)
        else:
            std = 0.02 if p.dim() == 2 else 0.01
            p.normal_(0.0, std, generator=gen)
