"""Qwen2ForCausalLM, hand-written over a flat token batch and a paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from nanoqwen.attention.metadata import AttentionBackend, AttentionMetadata
from nanoqwen.attention.rotary import RotaryEmbedding
from nanoqwen.kernels.layer_ops import LayerOps
from nanoqwen.model.config import ModelConfig
from nanoqwen.model.layers import MLP, Linear, RMSNorm
from nanoqwen.model.summed_row import SummedRow, summed_mlp_half, takes_squares
from nanoqwen.model.tensor_parallel import (
    ReducingRMSNorm,
    TensorParallel,
    embed_vocab_parallel,
    gather_vocab,
    shard_config,
)


def _norm(cfg: ModelConfig, tp: TensorParallel | None, dtype, device) -> RMSNorm:
    """Every norm's input is a row-parallel output when the model is split (o_proj,
    down_proj, the embedding): the norm sums it over the ranks."""
    if tp is None:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
    return ReducingRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, tp)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device):
        super().__init__()
        self.q_size = cfg.q_size
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, True, dtype, device)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, False, dtype, device)
        # Bound by the ModelRunner once the KV pool exists.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend: AttentionBackend | None = None

    def heads(self, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The attention heads' output, [tokens, q_size], before o_proj."""
        out = self.backend.forward(qkv, self.k_cache, self.v_cache, meta)
        return out.reshape(-1, self.q_size)


class DecoderLayer(nn.Module):
    # set_ops': the launches that run an add+RMSNorm inside the GEMV after it (one row), or
    # None (no such kernels, or norms that sum over tensor-parallel ranks first).
    norm_gemv = None
    norm_gemv_silu_mul = None
    embed_norm_gemv = None

    def __init__(self, cfg: ModelConfig, dtype, device, tp: TensorParallel | None = None):
        super().__init__()
        self.input_layernorm = _norm(cfg, tp, dtype, device)
        self.self_attn = Attention(cfg, dtype, device)
        self.post_attention_layernorm = _norm(cfg, tp, dtype, device)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)

    def forward(
        self,
        x: torch.Tensor | SummedRow,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        ids: torch.Tensor | None = None,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor | SummedRow, torch.Tensor]:
        """x is the previous layer's output, not yet added to the residual stream, or a
        SummedRow (then residual is its stream); with ids (the first layer), x is the
        embedding table and the input its rows at ids. Returns (x, residual) in the same
        forms: a SummedRow where the layer's projections take squares (summed_row.py).
        next_norm: the next layer's input norm, for a SummedRow of weighted rows."""
        attn, mlp = self.self_attn, self.mlp
        dense = getattr(attn.qkv_proj, "gemv", False)
        norm = self.input_layernorm
        if isinstance(x, SummedRow):
            qkv = attn.qkv_proj.normed_row(x.stream, x.squares, norm, False, x.weighted)
            fused = qkv, x.stream
        else:
            fused = self._norm_into(x, residual, norm, attn.qkv_proj, dense, False, ids)
        if fused is None:
            if ids is not None:
                x = x[ids]
            h, residual = norm(x, residual)
            heads = attn.heads(attn.qkv_proj(h), meta)
        else:
            qkv, residual = fused
            heads = attn.heads(qkv, meta)
        norm = self.post_attention_layernorm
        if heads.shape[0] == 1 and self.sums_rows:
            out = summed_mlp_half(heads, residual, attn.o_proj, norm, mlp, next_norm)
            return out, out.stream
        h = attn.o_proj(heads)
        fused = self._norm_into(h, residual, norm, mlp.gate_up_proj, mlp.gemv, True)
        if fused is None:
            h, residual = norm(h, residual)
            return mlp(h), residual
        act, residual = fused
        return mlp.down_proj(act), residual

    @property
    def sums_rows(self) -> bool:
        """Whether one row runs summed_row.py's way through this layer."""
        attn, mlp = self.self_attn, self.mlp
        plain = type(self.input_layernorm) is RMSNorm
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return plain and takes_squares(*projections)

    def _norm_into(self, x, residual, norm, proj, dense: bool, silu_mul: bool, ids=None):
        """(proj(norm(x + residual)), with silu_mul SiLU·up of it, and x + residual) in one
        launch at one row, on set_ops' dense GEMVs (dense: proj takes them); None where they
        do not run. ids: x is the embedding table, the input its row at ids."""
        rows = x.shape[0] if ids is None else ids.shape[0]
        if rows != 1 or self.norm_gemv is None or not dense:
            return None
        if ids is not None:
            if self.embed_norm_gemv is None:
                return None
            return self.embed_norm_gemv(x, ids, norm.weight, norm.eps, proj.weight, proj.bias)
        if silu_mul:
            return self.norm_gemv_silu_mul(x, residual, norm.weight, norm.eps, proj.weight)
        return self.norm_gemv(x, residual, norm.weight, norm.eps, proj.weight, proj.bias)


class Qwen2ForCausalLM(nn.Module):
    # set_ops': one row's final add+RMSNorm and lm_head in one launch (float32 logits), or None
    norm_logits = None

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel | None = None,
    ) -> None:
        """With tp (size > 1) this rank's part of the model: config is then its shard's shapes
        (its heads, MLP columns and vocabulary rows), full_config the whole model's."""
        super().__init__()
        self.full_config = cfg
        self.tp = tp if tp is not None and tp.size > 1 else None
        if self.tp is not None:
            cfg = shard_config(cfg, self.tp)
        self.config = cfg
        tp = self.tp
        self.embed_tokens = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, dtype, device, tp) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = _norm(cfg, tp, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Parameter(torch.empty_like(self.embed_tokens), requires_grad=False)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_positions, cfg.rope_theta, device, cfg.rope_scaling
        )
        self.attention_backend: AttentionBackend | None = None  # set_attention_backend's
        # forward()'s x where the last layer added its output to the residual stream itself
        # (summed_row.py): never written, as the norms after it write only the residual
        self.register_buffer(
            "zero_row", torch.zeros(1, cfg.hidden_size, dtype=dtype, device=device), False
        )

    def set_ops(self, ops: LayerOps) -> None:
        """The device's kernels for every norm and MLP, and its single-row GEMVs for the
        weights they take (LayerOps.gemv_pays). Before quantization swaps in layers with
        kernels of their own."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP, Linear)):
                module.ops = ops
            if isinstance(module, Linear):
                module.gemv = ops.gemv is not None and ops.gemv_pays(module.weight)
            if isinstance(module, MLP):
                weight = module.gate_up_proj.weight
                module.gemv = ops.gemv_silu_mul is not None and ops.gemv_pays(weight)
            if isinstance(module, DecoderLayer) and type(module.input_layernorm) is RMSNorm:
                module.norm_gemv = ops.norm_gemv
                module.norm_gemv_silu_mul = ops.norm_gemv_silu_mul
                module.embed_norm_gemv = ops.embed_norm_gemv
        fuses = type(self.norm) is RMSNorm and ops.gemv_pays(self.lm_head)
        self.norm_logits = ops.norm_logits if fuses else None

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        self.attention_backend = backend
        for layer in self.layers:
            layer.self_attn.backend = backend

    def bind_kv_cache(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        for layer, k, v in zip(self.layers, k_caches, v_caches, strict=True):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k, v

    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (last layer output, residual stream) of every token, before the final add
        and norm, so that logits can be computed for only the rows that need them."""
        ids = None
        if self.tp is not None:
            x = embed_vocab_parallel(self.embed_tokens, input_ids, self.tp)
        elif isinstance(self.embed_tokens, torch.Tensor):
            # the first layer gathers its input: at one row its GEMV reads the table itself
            x, ids = self.embed_tokens, input_ids
        else:  # a QuantizedEmbedding
            x = self.embed_tokens[input_ids]
        residual = None
        behind = [layer.input_layernorm for layer in self.layers[1:]] + [None]
        for layer, next_norm in zip(self.layers, behind, strict=True):
            x, residual = layer(x, residual, meta, ids, next_norm)
            ids = None
        if isinstance(x, SummedRow):
            # residual already holds the last layer's output: x + residual is residual
            x = self.zero_row
        return x, residual

    def compute_logits(
        self, hidden: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden: forward()'s pair, already cut to the rows that need logits. out: a float32
        [rows, vocab] tensor the logits are written into (the CUDA graphs' shared output)."""
        x, residual = hidden
        if isinstance(self.lm_head, nn.Module):  # a QuantizedLinear (nanoqwen.quant)
            normed, _ = self.norm(x, residual)
            return _as_float32(self.lm_head(normed), out)
        if x.shape[0] == 1 and self.norm_logits is not None:
            # the final add+RMSNorm in the lm_head GEMV's prologue, float32 logits
            w = self.norm.weight
            return self.norm_logits(x, residual, w, self.norm.eps, self.lm_head, out)
        normed, _ = self.norm(x, residual)
        if self.tp is None and normed.is_cuda and normed.dtype != torch.float32:
            # float32 logits straight from the GEMM's float32 sums: no bf16 rounding of the
            # logits (HF's, which moves a logit near 8 by up to 0.03) and no separate cast
            # kernel over a [rows, vocab] tensor.
            if out is None:
                return torch.mm(normed, self.lm_head.t(), out_dtype=torch.float32)
            return torch.mm(normed, self.lm_head.t(), out_dtype=torch.float32, out=out)
        logits = torch.nn.functional.linear(normed, self.lm_head)
        if self.tp is not None:
            logits = gather_vocab(logits, self.full_config.vocab_size, self.tp)
        return _as_float32(logits, out)


def _as_float32(logits: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return logits.float() if out is None else out.copy_(logits)
