"""Megatron-style tensor parallelism of the Qwen2 layers over N ranks.

Each rank holds every N-th part of the model: its own attention heads and KV heads (q, k and
v are split separately, so its fused qkv_proj is [its q | its k | its v]), its own slice of
the MLP's intermediate columns (gate and up split separately), and its own rows of the
vocabulary. o_proj and down_proj are row-parallel: each rank multiplies its slice and one
all-reduce per layer sums the partial outputs, so the residual stream is whole on every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nanoqwen.errors import InvalidInputError
from nanoqwen.model.layers import Linear
from nanoqwen.weights.config import ModelConfig

if TYPE_CHECKING:
    from nanoqwen.runtime.parallel.custom_all_reduce import CustomAllReduce


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (group None: the default group)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None
    # The one-shot all-reduce over peer-mapped GPU buffers, where the ranks can run it
    # (runtime/parallel/custom_all_reduce.py); None: the group's collective for every call.
    custom_all_reduce: CustomAllReduce | None = field(default=None, compare=False)

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sums x over the ranks, in place: the custom all-reduce for the messages it takes,
        NCCL (gloo on the CPU) for the others."""
        if self.custom_all_reduce is None or not self.custom_all_reduce(x):
            dist.all_reduce(x, group=self.group)

    def vocab_shard(self, vocab_size: int) -> int:
        """Rows of the embedding and lm_head each rank holds; the last is zero-padded."""
        return -(-vocab_size // self.size)


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Refuses a tensor_parallel_size the model's heads or MLP cannot be split over."""
    allowed = "a tensor_parallel_size that divides"
    if cfg.num_key_value_heads % size:
        raise InvalidInputError(
            f"tensor_parallel_size={size} does not divide the model's "
            f"num_key_value_heads={cfg.num_key_value_heads} (each rank holds whole KV heads): "
            f"allowed {allowed} {cfg.num_key_value_heads}",
            param="tensor_parallel_size",
        )
    # heads are a multiple of the KV heads (config.py checks), so they split too.
    if cfg.intermediate_size % size:
        raise InvalidInputError(
            f"tensor_parallel_size={size} does not divide the model's "
            f"intermediate_size={cfg.intermediate_size}: allowed {allowed} "
            f"{cfg.intermediate_size}",
            param="tensor_parallel_size",
        )


def shard_config(cfg: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The shapes one rank holds: its heads, its MLP columns, its vocabulary rows."""
    check_tensor_parallel(cfg, tp.size)
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // tp.size,
        num_key_value_heads=cfg.num_key_value_heads // tp.size,
        intermediate_size=cfg.intermediate_size // tp.size,
        vocab_size=tp.vocab_shard(cfg.vocab_size),
    )


class RowParallelLinear(Linear):
    """A Linear over this rank's slice of the input features; the all-reduce sums the
    ranks' partial products into the full output (no bias: o_proj and down_proj have none)."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, dtype, device):
        super().__init__(in_features, out_features, False, dtype, device)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.tp.all_reduce(out)
        return out


def embed_vocab_parallel(
    table: torch.Tensor, input_ids: torch.Tensor, tp: TensorParallel
) -> torch.Tensor:
    """Embedding rows from a table split by vocabulary: each rank fills the rows of the ids
    it holds and zeros elsewhere; the all-reduce adds exactly one non-zero row per token."""
    local = input_ids - tp.rank * table.shape[0]
    mine = (local >= 0) & (local < table.shape[0])
    rows = torch.nn.functional.embedding(local.clamp(0, table.shape[0] - 1), table)
    # masked_fill, not torch.where with a CPU zero: a CPU tensor cannot enter a CUDA graph.
    out = rows.masked_fill(~mine.unsqueeze(-1), 0)
    tp.all_reduce(out)
    return out


# torch >= 2.13 renames all_gather_into_tensor; the GPU machines run older torch.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_vocab(local: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor:
    """[rows, vocab/N] logits of each rank -> [rows, vocab] on every rank (padding cut).

    An all-gather rather than a gather to rank 0: it is one collective that CUDA graphs
    capture on every backend, and the other ranks' copy is small next to the step."""
    rows, shard = local.shape
    if rows == 0:  # every rank has the same row count, so all skip together
        return local.new_empty(0, vocab_size)
    out = local.new_empty(tp.size * rows, shard)
    _all_gather(out, local.contiguous(), group=tp.group)
    return out.view(tp.size, rows, shard).transpose(0, 1).reshape(rows, -1)[:, :vocab_size]
