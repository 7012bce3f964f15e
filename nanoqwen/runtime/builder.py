"""Assembles an engine from an EngineConfig: model config, weights, attention backend, KV
pool, scheduler and runner."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoqwen.attention.backends import create_backend, native_problem
from nanoqwen.errors import InvalidInputError
from nanoqwen.kernels.cpu.gguf import gguf_kernel
from nanoqwen.kernels.layer_ops import cpu_ops, triton_ops
from nanoqwen.model.config import ModelConfig
from nanoqwen.model.load_checkpoint import checkpoint_dtype, load_weights
from nanoqwen.model.load_gguf import load_gguf, open_gguf
from nanoqwen.model.quantize import describe, quantize_loaded
from nanoqwen.model.qwen2 import Qwen2ForCausalLM
from nanoqwen.model.shapes import fill_random, shape_config
from nanoqwen.model.tensor_parallel import check_tensor_parallel
from nanoqwen.quant.scheme import Scheme, resolve_scheme
from nanoqwen.runtime.config import EngineConfig
from nanoqwen.runtime.cuda_graph import CUDAGraphRunner
from nanoqwen.runtime.device_choice import default_is_quantized, resolve_device, resolve_dtype
from nanoqwen.runtime.graph_logits import allocate_graph_logits
from nanoqwen.runtime.kv.block_manager import BlockManager
from nanoqwen.runtime.kv.cache import KVCache
from nanoqwen.runtime.kv.host_pool import HostKVCache
from nanoqwen.runtime.kv.sizing import agree_on_fewest, fitting_num_blocks
from nanoqwen.runtime.model_runner import ModelRunner
from nanoqwen.runtime.parallel.group import ParallelContext, leave_group
from nanoqwen.runtime.parallel.launch import start_group
from nanoqwen.runtime.parallel.message import StepChannel
from nanoqwen.runtime.parallel.runner import ParallelModelRunner, RecordingHostKVCache
from nanoqwen.runtime.parallel.worker import WorkerRunner
from nanoqwen.runtime.prefill_graph import PrefillGraphRunner
from nanoqwen.runtime.sampling.sampler import Sampler
from nanoqwen.runtime.scheduler import Scheduler, SchedulerConfig
from nanoqwen.runtime.spec.verify_graph import VerifyGraphRunner, verify_rows
from nanoqwen.validation import invalid
from nanoqwen.weights.gguf import GGUFCheckpoint, is_gguf
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


@dataclass
class _Source:
    """Where the weights come from: a checkpoint directory, a GGUF file, or neither (random)."""

    cfg: ModelConfig
    tokenizer: Tokenizer | None
    stored: torch.dtype
    path: Path | None = None
    gguf: GGUFCheckpoint | None = None


def log(message: str) -> None:
    print(f"[nanoqwen] {message}", file=sys.stderr, flush=True)


def _open_source(c: EngineConfig, dev: torch.device, worker: bool) -> _Source:
    if c.random_shape is not None:
        return _Source(shape_config(c.random_shape), None, torch.bfloat16)
    if c.model is None and default_is_quantized(
        dev, c.dtype, c.quantization, c.tensor_parallel_size
    ):
        gguf, cfg, tokenizer = open_gguf(resolve_default_gguf(), default_tokenizer_dir())
        if c.progress:
            log(f"model: {gguf.path} (quantized; --quantization none: the float checkpoint)")
        return _Source(cfg, tokenizer, torch.bfloat16, gguf=gguf)
    if is_gguf(c.model):
        gguf, cfg, tokenizer = open_gguf(c.model)
        return _Source(cfg, tokenizer, torch.bfloat16, gguf=gguf)
    path = resolve_model(c.model)
    cfg = ModelConfig.from_file(path / "config.json")
    tokenizer = None if worker else Tokenizer(path)
    return _Source(cfg, tokenizer, checkpoint_dtype(path), path=path)


def build_engine(config: EngineConfig, parallel: ParallelContext | None = None):
    """The engine's parts. With config.tensor_parallel_size N > 1 this also starts the other
    N - 1 ranks; on those (parallel given, rank > 0) it returns their WorkerRunner instead."""
    c = config
    worker = parallel is not None and parallel.tp.rank > 0
    dev = parallel.device if parallel is not None else resolve_device(c.device)
    src = _open_source(c, dev, worker)
    gguf = src.gguf is not None
    kernels = gguf and c.quantization == "auto" and gguf_kernel() is not None
    torch_dtype = resolve_dtype(c.dtype, dev, src.stored, gguf_kernels=kernels)
    blocks = dev.type == "cpu" and torch_dtype != torch.float32 and gguf
    scheme = resolve_scheme(c.quantization, gguf, dev.type, blocks and gguf_kernel() is not None)
    workers = None
    if c.tensor_parallel_size > 1:
        check_tensor_parallel(src.cfg, c.tensor_parallel_size)  # before any process starts
        if scheme is not None:
            raise InvalidInputError(
                f"tensor_parallel_size={c.tensor_parallel_size} with quantized weights "
                f"(quantization={c.quantization!r}{', a GGUF model' if gguf else ''}) is not "
                "supported: allowed tensor_parallel_size=1, or a safetensors checkpoint with "
                "quantization='none' or 'auto'",
                param="tensor_parallel_size",
            )
        if parallel is None:
            # The workers build their engines with this same function, handed to them.
            parallel, workers = start_group(c, build_engine)
            dev = parallel.device
    try:
        return _assemble(c, src, scheme, torch_dtype, dev, parallel, workers)
    except BaseException as e:
        if workers is None:
            raise
        error = workers.stop_after(e)  # a dead rank's own error, if one died
        leave_group()
        if error is e:
            raise
        raise error from e


def _assemble(
    c: EngineConfig,
    src: _Source,
    scheme: Scheme | None,
    torch_dtype: torch.dtype,
    dev: torch.device,
    parallel: ParallelContext | None,
    workers,
):
    """The model, KV pool, scheduler and runner of build_engine()'s checked settings."""
    cfg, tokenizer, progress = src.cfg, src.tokenizer, c.progress
    block_size, max_num_seqs = c.block_size, c.max_num_seqs
    num_kv_blocks, max_model_len = c.num_kv_blocks, c.max_model_len
    worker = parallel is not None and parallel.tp.rank > 0
    net = Qwen2ForCausalLM(cfg, torch_dtype, dev, parallel.tp if parallel else None)
    # Before the weights load, so an impossible backend choice fails at once.
    fp8_kv = c.kv_cache_dtype != "auto"
    backend = create_backend(
        c.attention_backend,
        net.rotary,
        cfg.head_dim**-0.5,
        dev,
        torch_dtype,
        cfg.head_dim,
        block_size,
        fp8_kv,
    )
    kv_dtype = torch.float8_e4m3fn if fp8_kv else torch_dtype
    net.set_attention_backend(backend)
    # Before loading: quantization swaps in layers that keep their own kernels.
    if dev.type == "cuda" and torch_dtype in (torch.float16, torch.bfloat16):
        net.set_ops(triton_ops())
    elif native_problem(dev, torch_dtype) is None:
        net.set_ops(cpu_ops())
    if src.path is None and src.gguf is None:
        fill_random(net, seed=parallel.tp.rank if parallel else 0)
    elif src.gguf is not None:
        load_gguf(net, src.gguf, scheme, torch_dtype, progress=progress)
    else:
        load_weights(net, src.path, progress=progress)
    if scheme is not None and src.gguf is None:
        quantize_loaded(net, scheme, torch_dtype)
    if progress and scheme is not None:
        log(f"quantized linear layers: {describe(net)}")
    if progress:
        log(f"attention backend: {backend.name} ({dev}, {str(torch_dtype).removeprefix('torch.')})")

    eos = tokenizer.eos_token_ids if tokenizer is not None else frozenset(cfg.eos_token_id)
    # Before the KV pool is sized: the sampler's per-slot token tables take memory too.
    sampler = None if worker else Sampler(eos, cfg.vocab_size, max_num_seqs, dev)
    # And the graphs' one logits output (graph_logits.py), which the KV pool must leave room for.
    graph_logits = None
    if dev.type == "cuda" and not c.enforce_eager and backend.graph_variants(cfg.max_positions):
        graph_logits = allocate_graph_logits(_graph_logit_rows(c), net)
    per_block = KVCache.bytes_per_block(net.config, block_size, kv_dtype)
    if num_kv_blocks is None:
        tokens = min(c.max_num_batched_tokens, max_model_len or cfg.max_positions)
        num_kv_blocks = fitting_num_blocks(
            net, per_block, block_size, tokens, max_num_seqs, c.gpu_memory_utilization
        )
    if parallel is not None:  # every rank holds the same blocks: the fewest any can
        num_kv_blocks = agree_on_fewest(num_kv_blocks, parallel.control)
    limit = min(cfg.max_positions, num_kv_blocks * block_size)
    if max_model_len is not None and max_model_len > limit:
        context = "max_position_embeddings" if cfg.rope_scaling is None else "YaRN-scaled context"
        why = (
            f"the model's {context}"
            if limit == cfg.max_positions
            else f"what the KV cache holds: num_kv_blocks={num_kv_blocks} x block_size={block_size}"
        )
        raise invalid("max_model_len", max_model_len, "is too long", f"at most {limit}, {why}")
    max_len = max_model_len or limit
    kv = KVCache.allocate(net.config, num_kv_blocks, block_size, kv_dtype, dev)
    if progress:
        log(
            f"KV cache ({str(kv_dtype).removeprefix('torch.')}): {num_kv_blocks} blocks of "
            f"{block_size} tokens = "
            f"{num_kv_blocks * block_size} tokens ({num_kv_blocks * per_block / 2**30:.2f} GiB), "
            f"{num_kv_blocks * block_size // max_len} sequences of max length {max_len}"
        )
    host = None
    num_host_blocks = int(c.swap_space * 2**30) // per_block
    if num_host_blocks > 0:
        host_class = HostKVCache
        if parallel is not None and not worker:
            host_class = RecordingHostKVCache
        host = host_class(kv, num_host_blocks)
        if progress:
            log(
                f"host KV pool: {num_host_blocks} blocks ({num_host_blocks * per_block / 2**30:.2f}"
                f" GiB{', pinned' if dev.type == 'cuda' else ''}); "
                f"preemption: {c.preemption_mode}"
            )
    graphs = None
    variants = backend.graph_variants(max_len)
    if graph_logits is not None:  # made wherever graphs are captured
        scratch = sampler.state.scratch if sampler else 0
        graphs = CUDAGraphRunner(max_num_seqs, kv, scratch, graph_logits)
    # The longest chunk there can be; every rank computes the same, so all capture alike.
    longest = min(c.max_num_batched_tokens, max_len)
    prefill_graphs = _prefill_graphs(graphs, backend, kv, longest, max_num_seqs)
    if worker:
        runner = WorkerRunner(net, kv, host, graphs, prefill_graphs, parallel)
        _capture(runner, max_len, variants, backend.cascade_from, progress=False)
        return runner
    blocks = BlockManager(num_kv_blocks, block_size, c.enable_prefix_caching, host)
    sched_config = SchedulerConfig(max_num_seqs, c.max_num_batched_tokens, c.preemption_mode)
    scheduler = Scheduler(sched_config, blocks, sampler.release)
    if parallel is None:
        verify_graphs = _verify_graphs(c, graphs, backend, kv)
        runner = ModelRunner(net, kv, blocks, sampler, graphs, prefill_graphs, verify_graphs)
    else:
        channel = StepChannel(parallel)
        runner = ParallelModelRunner(
            net, kv, blocks, sampler, graphs, prefill_graphs, channel, workers
        )
    _capture(runner, max_len, variants, backend.cascade_from, progress)
    if runner.verify_graphs is not None:
        runner.verify_graphs.capture(runner, max_len, runner.graphs.pool, progress)
    return EngineParts(cfg, tokenizer, net, scheduler, runner, max_len, eos)


def capture_logits_graphs(parts: EngineParts, progress: bool = False) -> None:
    """Decode graphs that stop at the logits, for an engine built eagerly whose steps are
    sampled by someone else (a draft model's, spec/draft.py)."""
    runner, kv = parts.runner, parts.runner.kv
    if runner.device.type != "cuda":
        return
    variants = parts.model.attention_backend.graph_variants(parts.max_model_len)
    graphs = CUDAGraphRunner(parts.scheduler.config.max_num_seqs, kv, runner.sampler.state.scratch)
    graphs.capture(runner, parts.max_model_len, variants, progress, sampling=False)
    runner.graphs = graphs


def _prefill_graphs(graphs, backend, kv: KVCache, max_tokens: int, max_num_seqs: int):
    """Graphs for short prefill-shaped steps (a prompt, a mixed step) wherever decode has
    graphs and the backend can capture a prefill."""
    if graphs is None or not backend.captures_prefill:
        return None
    return PrefillGraphRunner(max_tokens, max_num_seqs, kv, graphs.sampler_scratch, graphs.logits)


def _verify_graphs(c: EngineConfig, graphs, backend, kv: KVCache):
    """Graphs for speculative verify steps, which are laid out as prefill chunks."""
    spec = c.speculative_config
    if spec is None or graphs is None or not backend.captures_prefill:
        return None
    k = spec.num_speculative_tokens
    return VerifyGraphRunner(k, c.max_num_seqs, kv, graphs.sampler_scratch, graphs.logits)


def _graph_logit_rows(c: EngineConfig) -> int:
    """The rows of the graphs' shared logits buffer (graph_logits.py): a decode batch's, or
    a verify graph's when speculation makes those more."""
    spec = c.speculative_config
    if spec is None:
        return c.max_num_seqs
    return max(c.max_num_seqs, verify_rows(spec.num_speculative_tokens, c.max_num_seqs))


def _capture(runner, max_len: int, variants, cascade_from: int | None, progress: bool) -> None:
    """Decode graphs, then prefill graphs in their memory pool; every tensor-parallel rank
    in the same order, so the capture warm-ups' collectives pair."""
    if runner.graphs is not None:
        runner.graphs.capture(runner, max_len, variants, progress, cascade_from)
    if runner.prefill_graphs is not None:
        runner.prefill_graphs.capture(runner, max_len, runner.graphs.pool, progress)
