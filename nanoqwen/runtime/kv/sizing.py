"""How many KV blocks an engine gets when the user does not say: a fixed budget on the CPU,
on a GPU what its memory holds after the weights and the largest prefill's activations."""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.errors import InvalidInputError
from nanoqwen.model.qwen2 import Qwen2ForCausalLM
from nanoqwen.runtime.kv.cache import KVCache

CPU_KV_BUDGET_BYTES = 1 << 30


def fitting_num_blocks(
    net: Qwen2ForCausalLM,
    per_block: int,
    block_size: int,
    max_prefill_tokens: int,
    max_num_seqs: int,
    gpu_memory_utilization: float,
) -> int:
    dev = net.embed_tokens.device
    if dev.type == "cpu":
        return max(1, CPU_KV_BUDGET_BYTES // per_block)
    logit_rows = min(max_num_seqs, max_prefill_tokens)
    peak = _profile_peak_bytes(net, max_prefill_tokens, logit_rows, block_size)
    return _gpu_num_blocks(dev, per_block, peak, gpu_memory_utilization)


def agree_on_fewest(num_blocks: int, group: dist.ProcessGroup) -> int:
    """Tensor parallelism: every rank holds the same blocks, the fewest any rank can."""
    agreed = torch.tensor([num_blocks])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return int(agreed)


@torch.inference_mode()
def _profile_peak_bytes(
    net: Qwen2ForCausalLM, tokens: int, logit_rows: int, block_size: int
) -> int:
    """Peak bytes of a prefill as large as the scheduler can ever send, weights included."""
    dev = net.embed_tokens.device
    blocks = -(-tokens // block_size)
    kv = KVCache.allocate(net.config, blocks, block_size, net.embed_tokens.dtype, dev)
    net.bind_kv_cache(kv.k, kv.v)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    i32 = dict(dtype=torch.int32, device=dev)
    meta = AttentionMetadata(
        is_prefill=True,
        positions=torch.arange(tokens, device=dev),
        slot_mapping=torch.arange(tokens, device=dev),
        context_lens=torch.tensor([tokens], **i32),
        block_tables=torch.arange(blocks, **i32).unsqueeze(0),
        cu_seqlens_q=torch.tensor([0, tokens], **i32),
        max_seqlen_q=tokens,
        max_seqlen_k=tokens,
        cu_seqlens_k=torch.tensor([0, tokens], **i32),
    )
    ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
    x, residual = net(ids, meta)
    net.compute_logits((x[-logit_rows:], residual[-logit_rows:]))
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    del kv, x, residual
    net.bind_kv_cache([torch.empty(0)] * len(net.layers), [torch.empty(0)] * len(net.layers))
    torch.cuda.empty_cache()
    return peak


def _gpu_num_blocks(dev: torch.device, per_block: int, peak: int, utilization: float) -> int:
    free, total = torch.cuda.mem_get_info(dev)
    other_processes = total - free - torch.cuda.memory_reserved(dev)
    # Room for the captured graphs' activations and allocator fragmentation.
    headroom = 512 << 20
    usable = total * utilization - peak - other_processes - headroom
    if usable < per_block:
        raise InvalidInputError(
            f"no GPU memory left for the KV cache at gpu_memory_utilization={utilization}: "
            f"weights and activations peak at {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB; "
            "allowed a larger gpu_memory_utilization or a smaller model",
            param="gpu_memory_utilization",
        )
    return int(usable // per_block)
