"""Assembles an engine: config, weights, attention backend, KV pool, scheduler, runner."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from nanoqwen.errors import InvalidInputError
from nanoqwen.model.parallel import check_tensor_parallel
from nanoqwen.model.qwen2 import Qwen2ForCausalLM
from nanoqwen.model.shapes import SHAPES, fill_random, shape_config
from nanoqwen.quant.apply import describe, quantize_loaded
from nanoqwen.quant.native import gguf_kernel
from nanoqwen.quant.scheme import QUANTIZATIONS, resolve_scheme
from nanoqwen.runtime.attention import BACKENDS, AttentionMetadata, create_backend
from nanoqwen.runtime.block_manager import BlockManager
from nanoqwen.runtime.host_pool import HostKVCache
from nanoqwen.runtime.kv_cache import KVCache
from nanoqwen.runtime.model_runner import ModelRunner
from nanoqwen.runtime.parallel.group import ParallelContext, leave_group
from nanoqwen.runtime.sampling.sampler import Sampler
from nanoqwen.runtime.scheduler import PREEMPTION_MODES, Scheduler, SchedulerConfig
from nanoqwen.validation import boolean, check_engine_args, choice, integer, invalid, number
from nanoqwen.weights.config import ModelConfig
from nanoqwen.weights.gguf import is_gguf
from nanoqwen.weights.gguf_loader import load_gguf, open_gguf
from nanoqwen.weights.hub import default_model_dir, resolve_default_gguf, resolve_model
from nanoqwen.weights.loader import checkpoint_dtype, load_weights
from nanoqwen.weights.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_BUDGET_BYTES = 1 << 30


@dataclass
class EngineParts:
    config: ModelConfig
    tokenizer: Tokenizer | None
    model: Qwen2ForCausalLM
    scheduler: Scheduler
    runner: ModelRunner
    max_model_len: int
    eos_token_ids: frozenset[int]


def resolve_device(device: str) -> torch.device:
    allowed = "cpu, cuda, cuda:N"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise invalid("device", device, "is unknown", allowed) from None
    if dev.type not in ("cpu", "cuda"):
        raise invalid("device", device, "is not supported", allowed)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise invalid("device", device, "but CUDA is not available on this machine", "cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise invalid(
            "device", device, "does not exist", f"cuda:0..cuda:{torch.cuda.device_count() - 1}"
        )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def cpu_has_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic natively (AVX512-BF16 or AMX), as torch sees it."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_dtype(dtype: str, device: torch.device, stored: torch.dtype) -> torch.dtype:
    """auto: the checkpoint's dtype on CUDA; on the CPU bfloat16 where the CPU has bf16
    instructions, except for float32 checkpoints, which stay float32 as on CUDA."""
    if dtype == "auto":
        if device.type == "cuda":
            return stored
        return torch.bfloat16 if stored != torch.float32 and cpu_has_bf16() else torch.float32
    return DTYPES[choice("dtype", dtype, ["auto", *DTYPES])]


def _default_is_quantized(dev: torch.device, dtype: str, quantization: str, tp: int) -> bool:
    """Whether no --model means the default model's GGUF, quantized: on the CPU with
    quantization="auto" and bf16/fp16 activations (float32, the token-exact mode, and the
    GPU run the float checkpoint, as do tensor-parallel runs, which take no quantized
    weights)."""
    if dev.type != "cpu" or quantization != "auto" or tp != 1:
        return False
    return resolve_dtype(dtype, dev, torch.bfloat16) != torch.float32


def default_tokenizer_dir() -> Path | None:
    """The float checkpoint's directory when it is built (its tokenizer is the one made from
    the GGUF's metadata, and serve and the CLI read it too); None: the GGUF's metadata."""
    path = default_model_dir()
    return path if (path / "tokenizer.json").is_file() else None


def log(message: str) -> None:
    print(f"[nanoqwen] {message}", file=sys.stderr, flush=True)


def build_engine(
    model: str | None,
    device: str,
    dtype: str,
    block_size: int,
    num_kv_blocks: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int | None,
    attention_backend: str,
    enforce_eager: bool,
    gpu_memory_utilization: float,
    enable_prefix_caching: bool,
    preemption_mode: str,
    swap_space: float,
    random_shape: str | None,
    progress: bool,
    tensor_parallel_size: int = 1,
    quantization: str = "auto",
    parallel: ParallelContext | None = None,
) -> EngineParts:
    """With tensor_parallel_size N > 1 this also starts the other N - 1 ranks; on those
    (parallel given, rank > 0) it returns their WorkerRunner instead."""
    engine_kwargs = {k: v for k, v in locals().items() if k != "parallel"}
    check_engine_args(
        model=model,
        device=device,
        dtype=dtype,
        dtypes=list(DTYPES),
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        attention_backend=attention_backend,
        backends=BACKENDS,
        enforce_eager=enforce_eager,
        gpu_memory_utilization=gpu_memory_utilization,
        random_shape=random_shape,
        shapes=SHAPES,
        progress=progress,
    )
    boolean("enable_prefix_caching", enable_prefix_caching)
    choice("preemption_mode", preemption_mode, PREEMPTION_MODES)
    number("swap_space", swap_space, lambda v: v >= 0, "a number of GiB >= 0")
    integer("tensor_parallel_size", tensor_parallel_size, lambda v: v >= 1, "an integer >= 1")
    sched_config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, preemption_mode)
    choice("quantization", quantization, QUANTIZATIONS)
    worker = parallel is not None and parallel.tp.rank > 0
    dev = parallel.device if parallel is not None else resolve_device(device)
    path = gguf = None
    if random_shape is not None:
        cfg, tokenizer, stored = shape_config(random_shape), None, torch.bfloat16
    elif model is None and _default_is_quantized(dev, dtype, quantization, tensor_parallel_size):
        gguf, cfg, tokenizer = open_gguf(resolve_default_gguf(), default_tokenizer_dir())
        stored = torch.bfloat16
        if progress:
            log(f"model: {gguf.path} (quantized; --quantization none: the float checkpoint)")
    elif is_gguf(model):
        gguf, cfg, tokenizer = open_gguf(model)
        stored = torch.bfloat16
    else:
        path = resolve_model(model)
        cfg = ModelConfig.from_file(path / "config.json")
        tokenizer = None if worker else Tokenizer(path)
        stored = checkpoint_dtype(path)
    torch_dtype = resolve_dtype(dtype, dev, stored)
    blocks = dev.type == "cpu" and torch_dtype != torch.float32 and gguf is not None
    scheme = resolve_scheme(
        quantization, gguf is not None, dev.type, blocks and gguf_kernel() is not None
    )
    workers = None
    if tensor_parallel_size > 1:
        check_tensor_parallel(cfg, tensor_parallel_size)  # before any process starts
        if scheme is not None:
            raise InvalidInputError(
                f"tensor_parallel_size={tensor_parallel_size} with quantized weights "
                f"(quantization={quantization!r}{', a GGUF model' if gguf else ''}) is not "
                "supported: allowed tensor_parallel_size=1, or a safetensors checkpoint with "
                "quantization='none' or 'auto'",
                param="tensor_parallel_size",
            )
        if parallel is None:
            from nanoqwen.runtime.parallel.launch import start_group

            parallel, workers = start_group(engine_kwargs, tensor_parallel_size)
            dev = parallel.device
    try:
        return _assemble(
            cfg, path, gguf, scheme, tokenizer, torch_dtype, dev, parallel, workers,
            engine_kwargs, sched_config,
        )  # fmt: skip
    except BaseException:
        if workers is not None:
            workers.stop(timeout=0)
            leave_group()
        raise


def _assemble(
    cfg, path, gguf, scheme, tokenizer, torch_dtype, dev, parallel, workers, kw, sched_config
):
    """The model, KV pool, scheduler and runner of build_engine()'s checked arguments."""
    block_size, max_num_seqs, progress = kw["block_size"], kw["max_num_seqs"], kw["progress"]
    num_kv_blocks, max_model_len = kw["num_kv_blocks"], kw["max_model_len"]
    worker = parallel is not None and parallel.tp.rank > 0
    net = Qwen2ForCausalLM(cfg, torch_dtype, dev, parallel.tp if parallel else None)
    # Before the weights load, so an impossible backend choice fails at once.
    backend = create_backend(
        kw["attention_backend"],
        net.rotary,
        cfg.head_dim**-0.5,
        dev,
        torch_dtype,
        cfg.head_dim,
        block_size,
    )
    net.set_attention_backend(backend)
    # Before loading: quantization swaps in layers that keep their own kernels.
    if dev.type == "cuda" and torch_dtype in (torch.float16, torch.bfloat16):
        net.use_fused_kernels(True)
    if path is None and gguf is None:
        fill_random(net, seed=parallel.tp.rank if parallel else 0)
    elif gguf is not None:
        load_gguf(net, gguf, scheme, torch_dtype, progress=progress)
    else:
        load_weights(net, path, progress=progress)
    if scheme is not None and gguf is None:
        quantize_loaded(net, scheme, torch_dtype)
    if progress and scheme is not None:
        log(f"quantized linear layers: {describe(net)}")
    if progress:
        log(f"attention backend: {backend.name} ({dev}, {str(torch_dtype).removeprefix('torch.')})")

    eos = tokenizer.eos_token_ids if tokenizer is not None else frozenset(cfg.eos_token_id)
    # Before the KV pool is sized: the sampler's per-slot token tables take memory too.
    sampler = None if worker else Sampler(eos, cfg.vocab_size, max_num_seqs, dev)
    per_block = KVCache.bytes_per_block(net.config, block_size, torch_dtype)
    if num_kv_blocks is None:
        if dev.type == "cpu":
            num_kv_blocks = max(1, CPU_KV_BUDGET_BYTES // per_block)
        else:
            tokens = min(kw["max_num_batched_tokens"], max_model_len or cfg.max_position_embeddings)
            peak = _profile_forward(net, tokens, min(max_num_seqs, tokens), block_size)
            util = kw["gpu_memory_utilization"]
            num_kv_blocks = _gpu_num_blocks(dev, per_block, peak, util)
    if parallel is not None:  # every rank holds the same blocks: the fewest any can
        agreed = torch.tensor([num_kv_blocks])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=parallel.control)
        num_kv_blocks = int(agreed)
    limit = min(cfg.max_position_embeddings, num_kv_blocks * block_size)
    if max_model_len is not None and max_model_len > limit:
        why = (
            "the model's max_position_embeddings"
            if limit == cfg.max_position_embeddings
            else f"what the KV cache holds: num_kv_blocks={num_kv_blocks} x block_size={block_size}"
        )
        raise invalid("max_model_len", max_model_len, "is too long", f"at most {limit}, {why}")
    max_len = max_model_len or limit
    kv = KVCache.allocate(net.config, num_kv_blocks, block_size, torch_dtype, dev)
    if progress:
        log(
            f"KV cache: {num_kv_blocks} blocks of {block_size} tokens = "
            f"{num_kv_blocks * block_size} tokens ({num_kv_blocks * per_block / 2**30:.2f} GiB), "
            f"{num_kv_blocks * block_size // max_len} sequences of max length {max_len}"
        )
    host = None
    num_host_blocks = int(kw["swap_space"] * 2**30) // per_block
    if num_host_blocks > 0:
        host_class = HostKVCache
        if parallel is not None and not worker:
            from nanoqwen.runtime.parallel.runner import RecordingHostKVCache as host_class
        host = host_class(kv, num_host_blocks)
        if progress:
            log(
                f"host KV pool: {num_host_blocks} blocks ({num_host_blocks * per_block / 2**30:.2f}"
                f" GiB{', pinned' if dev.type == 'cuda' else ''}); "
                f"preemption: {kw['preemption_mode']}"
            )
    graphs = None
    variants = backend.graph_variants(max_len)
    if dev.type == "cuda" and not kw["enforce_eager"] and variants:
        from nanoqwen.runtime.cuda_graph import CUDAGraphRunner

        graphs = CUDAGraphRunner(max_num_seqs, kv, sampler.state.scratch if sampler else 0)
    if worker:
        from nanoqwen.runtime.parallel.worker import WorkerRunner

        runner = WorkerRunner(net, kv, host, graphs, parallel)
        if graphs is not None:
            graphs.capture(
                runner, max_len, variants, progress=False, cascade_from=backend.cascade_from
            )
        return runner
    blocks = BlockManager(num_kv_blocks, block_size, kw["enable_prefix_caching"], host)
    scheduler = Scheduler(sched_config, blocks, sampler.release)
    if parallel is None:
        runner = ModelRunner(net, kv, blocks, sampler, graphs)
    else:
        from nanoqwen.runtime.parallel.message import StepChannel
        from nanoqwen.runtime.parallel.runner import ParallelModelRunner

        channel = StepChannel(parallel)
        runner = ParallelModelRunner(net, kv, blocks, sampler, graphs, channel, workers)
    if graphs is not None:
        graphs.capture(
            runner, max_len, variants, progress=progress, cascade_from=backend.cascade_from
        )
    return EngineParts(cfg, tokenizer, net, scheduler, runner, max_len, eos)


@torch.inference_mode()
def _profile_forward(net: Qwen2ForCausalLM, tokens: int, logit_rows: int, block_size: int) -> int:
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
