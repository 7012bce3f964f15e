"""Swaps a built model's linear layers (and lm_head) for QuantizedLinear, after construction,
so that the model classes stay as they are."""

from __future__ import annotations

import torch
from torch import nn

from nanoqwen.model.layers import MLP, Linear
from nanoqwen.model.qwen2 import Qwen2ForCausalLM
from nanoqwen.quant.format import QuantizedWeight
from nanoqwen.quant.gguf_packed import PackedBlocks, PackedParts
from nanoqwen.quant.linear import QuantizedLinear
from nanoqwen.quant.scheme import Scheme


def linear_names(net: Qwen2ForCausalLM) -> list[str]:
    """Dotted names of every Linear module (the fused qkv and gate_up included)."""
    return [name for name, m in net.named_modules() if isinstance(m, Linear)]


def set_module(net: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    owner = net.get_submodule(parent) if parent else net
    if child in owner._parameters:  # a parameter's name takes a module only once freed
        delattr(owner, child)
    setattr(owner, child, module)


def install(
    net: Qwen2ForCausalLM,
    weights: dict[str, QuantizedWeight | PackedBlocks | PackedParts],
    dtype: torch.dtype,
) -> None:
    """Replaces the modules named in `weights` ("lm_head" for the output projection) by
    prepared QuantizedLinear layers; biases are taken over from the modules replaced."""
    for name, w in weights.items():
        if name == "lm_head":
            layer = QuantizedLinear(w, None)
        else:
            old = net.get_submodule(name)
            layer = QuantizedLinear(w, None if old.bias is None else old.bias.detach())
        # Logits are computed for a few rows a step (but for prompt logprobs): the lm_head's
        # int8 copy for many-row matmuls waits until one comes.
        layer.prepare(dtype, prefill_copy=name != "lm_head")
        set_module(net, name, layer)
    for m in net.modules():
        if isinstance(m, MLP) and isinstance(m.gate_up_proj, QuantizedLinear):
            m.gemv = False  # the dense GEMV reads gate_up_proj.weight; quantized layers have none


def quantize_loaded(net: Qwen2ForCausalLM, scheme: Scheme, dtype: torch.dtype) -> None:
    """Quantizes a model whose float weights are loaded (a safetensors checkpoint); the token
    embedding stays float (a lookup reads one row per token)."""
    weights = {name: scheme.apply(net.get_submodule(name).weight) for name in linear_names(net)}
    weights["lm_head"] = scheme.apply(net.lm_head)
    install(net, weights, dtype)


def describe(net: nn.Module) -> str:
    """'int4 g32 int4pack x 49, ...': the quantized layers by layout and kernel."""
    counts: dict[str, int] = {}
    for m in net.modules():
        if isinstance(m, QuantizedLinear):
            key = m.layout
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} x {k}" for k, n in counts.items())


def quantized_bytes(net: nn.Module) -> int:
    """Bytes a decode step reads when the linear layers are quantized (0 when none is): the
    packed layers' tensors plus the float parameters outside the embedding."""
    layers = [m for m in net.modules() if isinstance(m, QuantizedLinear)]
    if not layers:
        return 0
    read = sum(layer.decode_bytes() for layer in layers)
    # The embedding is gathered a row per token; the lm_head is quantized, hence not it.
    floats = sum(
        p.numel() * p.element_size() for n, p in net.named_parameters() if n != "embed_tokens"
    )
    return read + floats
