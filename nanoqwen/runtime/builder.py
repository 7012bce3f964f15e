"""Assembles an engine: config, weights, attention backend, KV pool, scheduler, runner."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from nanoqwen.attention.backends import BACKENDS, create_backend, native_problem
from nanoqwen.errors import InvalidInputError
from nanoqwen.kernels.cpu.gguf import gguf_kernel
from nanoqwen.model.config import ModelConfig
from nanoqwen.model.load_checkpoint import checkpoint_dtype, load_weights
from nanoqwen.model.load_gguf import load_gguf, open_gguf
from nanoqwen.model.quantize import describe, quantize_loaded
from nanoqwen.model.qwen2 import Qwen2ForCausalLM
from nanoqwen.model.shapes import SHAPES, fill_random, shape_config
from nanoqwen.model.tensor_parallel import check_tensor_parallel
from nanoqwen.quant.scheme import QUANTIZATIONS, resolve_scheme
from nanoqwen.runtime.device_choice import (
    DTYPES,
    default_is_quantized,
    resolve_device,
    resolve_dtype,
)
from nanoqwen.runtime.kv.block_manager import BlockManager
from nanoqwen.runtime.kv.cache import KVCache
from nanoqwen.runtime.kv.host_pool import HostKVCache
from nanoqwen.runtime.kv.sizing import agree_on_fewest, fitting_num_blocks
from nanoqwen.runtime.model_runner import ModelRunner
from nanoqwen.runtime.parallel.group import ParallelContext, leave_group
from nanoqwen.runtime.sampling.sampler import Sampler
from nanoqwen.runtime.scheduler import PREEMPTION_MODES, Scheduler, SchedulerConfig
from nanoqwen.validation import boolean, check_engine_args, choice, integer, invalid, number
from nanoqwen.weights.gguf import is_gguf
from nanoqwen.weights.hub import default_tokenizer_dir, resolve_default_gguf, resolve_model
from nanoqwen.weights.tokenizer import Tokenizer


@dataclass
class EngineParts:
    config: ModelConfig
    tokenizer: Tokenizer | None
    model: Qwen2ForCausalLM
    scheduler: Scheduler
    runner: ModelRunner
    max_model_len: int
    eos_token_ids: frozenset[int]


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
    elif model is None and default_is_quantized(dev, dtype, quantization, tensor_parallel_size):
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
    elif native_problem(dev, torch_dtype) is None:
        net.use_native_kernels(True)
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
        tokens = min(kw["max_num_batched_tokens"], max_model_len or cfg.max_position_embeddings)
        num_kv_blocks = fitting_num_blocks(
            net, per_block, block_size, tokens, max_num_seqs, kw["gpu_memory_utilization"]
        )
    if parallel is not None:  # every rank holds the same blocks: the fewest any can
        num_kv_blocks = agree_on_fewest(num_kv_blocks, parallel.control)
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
    # The longest chunk there can be; every rank computes the same, so all capture alike.
    longest = min(kw["max_num_batched_tokens"], max_len)
    prefill_graphs = _prefill_graphs(graphs, backend, kv, longest)
    if worker:
        from nanoqwen.runtime.parallel.worker import WorkerRunner

        runner = WorkerRunner(net, kv, host, graphs, prefill_graphs, parallel)
        _capture(runner, max_len, variants, backend.cascade_from, progress=False)
        return runner
    blocks = BlockManager(num_kv_blocks, block_size, kw["enable_prefix_caching"], host)
    scheduler = Scheduler(sched_config, blocks, sampler.release)
    if parallel is None:
        runner = ModelRunner(net, kv, blocks, sampler, graphs, prefill_graphs)
    else:
        from nanoqwen.runtime.parallel.message import StepChannel
        from nanoqwen.runtime.parallel.runner import ParallelModelRunner

        channel = StepChannel(parallel)
        runner = ParallelModelRunner(
            net, kv, blocks, sampler, graphs, prefill_graphs, channel, workers
        )
    _capture(runner, max_len, variants, backend.cascade_from, progress)
    return EngineParts(cfg, tokenizer, net, scheduler, runner, max_len, eos)


def _prefill_graphs(graphs, backend, kv: KVCache, max_tokens: int):
    """Graphs for short single-sequence prefills wherever decode has graphs and the backend
    can capture a prefill."""
    if graphs is None or not backend.captures_prefill:
        return None
    from nanoqwen.runtime.prefill_graph import PrefillGraphRunner

    return PrefillGraphRunner(max_tokens, kv, graphs.sampler_scratch)


def _capture(runner, max_len: int, variants, cascade_from: int | None, progress: bool) -> None:
    """Decode graphs, then prefill graphs in their memory pool; every tensor-parallel rank
    in the same order, so the capture warm-ups' collectives pair."""
    if runner.graphs is not None:
        runner.graphs.capture(runner, max_len, variants, progress, cascade_from)
    if runner.prefill_graphs is not None:
        runner.prefill_graphs.capture(runner, max_len, runner.graphs.pool, progress)
