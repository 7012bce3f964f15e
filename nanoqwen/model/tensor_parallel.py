"""Megatron-style tensor parallelism of the Qwen2 layers over N ranks.

Each rank holds every N-th part of the model: its own attention heads and KV heads (q, k and
v are split separately, so its fused qkv_proj is [its q | its k | its v]), its own slice of
the MLP's intermediate columns (gate and up split separately), and its own rows of the
vocabulary. o_proj and down_proj are row-parallel: each rank multiplies its slice into a
partial sum of the output. The embedding is too (each rank fills the rows of the ids it
holds). Each of these partial sums is read by an RMSNorm, first thing: ReducingRMSNorm sums it
over the ranks there (one all-reduce per o_proj, per down_proj and for the embedding), fused
with the residual add and norm where the custom all-reduce can, so the residual stream is
whole on every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nanoqwen.errors import InvalidInputError
from nanoqwen.model.config import ModelConfig
from nanoqwen.model.layers import RMSNorm

if TYPE_CHECKING:
    from nanoqwen.runtime.parallel.custom_all_reduce import CustomAllReduce


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (group None: the default group)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None
    # The all-reduce (and all-gather) kernels over peer-mapped GPU buffers, where the ranks
    # can run them (runtime/parallel/custom_all_reduce.py); None: the group's collectives.
    custom_all_reduce: CustomAllReduce | None = field(default=None, compare=False)

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sums x over the ranks, in place: the custom all-reduce for the messages it takes,
        NCCL (gloo on the CPU) for the others."""
        if self.custom_all_reduce is None or not self.custom_all_reduce(x):
            dist.all_reduce(x, group=self.group)

    def all_gather(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Every rank's x into out, in rank order: the custom kernel where it takes x, NCCL
        (gloo on the CPU) otherwise."""
        if self.custom_all_reduce is None or not self.custom_all_reduce.all_gather(x, out):
            _all_gather(out, x, group=self.group)

    def broadcast(self, x: torch.Tensor) -> None:
        """Rank 0's x into every rank's x, in place: the custom kernel where it takes x, NCCL
        (gloo on the CPU) otherwise."""
        if self.custom_all_reduce is None or not self.custom_all_reduce.broadcast(x):
            dist.broadcast(x, group=self.group, group_src=0)

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


class ReducingRMSNorm(RMSNorm):
    """The RMSNorm whose input is this rank's partial sum of a row-parallel output: it sums
    the input over the ranks first (the residual add and norm then see the whole sum)."""

    def __init__(self, size: int, eps: float, dtype, device, tp: TensorParallel) -> None:
        super().__init__(size, eps, dtype, device)
        self.tp = tp

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x._base is not None:
            # A view of the model's output (rows cut for logits): summed here, not there.
            x = x.clone()
        custom = self.tp.custom_all_reduce
        # fused: the Triton add + norm (bf16/fp16 on CUDA), whose numerics the one kernel has.
        if self.ops.name == "triton" and custom is not None and custom.takes_rms_norm(x, residual):
            return custom.all_reduce_rms_norm(x, residual, self.weight, self.eps)
        self.tp.all_reduce(x)
        return super().forward(x, residual)


def embed_vocab_parallel(
    table: torch.Tensor, input_ids: torch.Tensor, tp: TensorParallel
) -> torch.Tensor:
    """This rank's partial sum of the embedding rows, from a table split by vocabulary: the
    rows of the ids it holds, zeros elsewhere; summed over the ranks (exactly one non-zero
    row per token) by the first layer's ReducingRMSNorm."""
    local = input_ids - tp.rank * table.shape[0]
    mine = (local >= 0) & (local < table.shape[0])
    rows = torch.nn.functional.embedding(local.clamp(0, table.shape[0] - 1), table)
    # masked_fill, not torch.where with a CPU zero: a CPU tensor cannot enter a CUDA graph.
    return rows.masked_fill(~mine.unsqueeze(-1), 0)


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
    tp.all_gather(out, local.contiguous())
    return out.view(tp.size, rows, shard).transpose(0, 1).reshape(rows, -1)[:, :vocab_size]
