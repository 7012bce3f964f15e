"""The benchmark's measurements: a latency run (decode steps of one batch), a throughput run
(many requests), and the device's copy bandwidth that bounds a decode step."""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch
from tqdm import tqdm

from nanoqwen.bench.workloads import throughput_workload
from nanoqwen.model.quantize import quantized_bytes
from nanoqwen.runtime.engine import LLM
from nanoqwen.runtime.sampling_params import SamplingParams
from nanoqwen.runtime.spec.speculator import SpeculationStats


def copy_ceiling_gbps(device: torch.device) -> float:
    """The device's memory bandwidth as a copy measures it (bytes read + written per second):
    what one decode step, which reads every weight once, cannot beat."""
    n = (1 << 30) if device.type == "cuda" else (1 << 28)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        _sync_device(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync_device(device)
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * n / statistics.median(times[1:]) / 1e9


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(llm: LLM) -> int:
    """Bytes one decode step reads: every weight, minus the embedding table when the
    lm_head is separate (decode gathers only a few embedding rows)."""
    if quantized_bytes(llm.runner.model):
        return quantized_bytes(llm.runner.model)
    cfg = llm.config
    params = cfg.num_parameters()
    if not cfg.tie_word_embeddings:
        params -= cfg.vocab_size * cfg.hidden_size
    return params * llm.runner.model.embed_tokens.element_size()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def speculation(before: dict, after: dict) -> dict:
    """Speculative decoding's acceptance between two LLM.stats(); {} without it."""
    if "spec_proposed_tokens" not in after:
        return {}
    since = SpeculationStats(
        *(after[k] - before[k] for k in ("spec_verified", "spec_proposed_tokens",
                                         "spec_accepted_tokens"))
    )  # fmt: skip
    return {
        "spec_acceptance_rate": since.acceptance_rate,
        "spec_mean_accepted_length": since.mean_accepted_length,
    }


def _sync(llm: LLM) -> None:
    if llm.runner.device.type == "cuda":
        torch.cuda.synchronize()


def latency_run(
    llm: LLM, bs: int, prompt_len: int, new_tokens: int, rng: random.Random, sampling: dict
):
    vocab = min(10000, llm.config.vocab_size)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(bs)]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, **sampling)
    seqs = [llm._add(p, params, detokenize=False) for p in prompts]
    before = llm.stats()
    _sync(llm)
    start = time.perf_counter()
    step_ms: list[float] = []
    first_token_s = None
    with tqdm(total=new_tokens - 1, desc=f"bs={bs}", leave=False, file=sys.stderr) as bar:
        while any(not s.is_finished for s in seqs):
            t0 = time.perf_counter()
            batch_was_prefill = bool(llm.scheduler.waiting)
            llm.step()
            dt = time.perf_counter() - t0
            if first_token_s is None and all(s.first_token_time for s in seqs):
                first_token_s = time.perf_counter() - start
            elif not batch_was_prefill:
                step_ms.append(dt * 1e3)
                bar.update()
    total = time.perf_counter() - start
    decode_s = sum(step_ms) / 1e3
    # A speculative step makes several tokens per sequence: count those after the first.
    decoded = sum(s.num_output_tokens - 1 for s in seqs) if llm.speculator else bs * len(step_ms)
    return {
        "batch_size": bs,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "ttft_ms": first_token_s * 1e3,
        "prefill_tok_s": bs * prompt_len / first_token_s,
        "step_ms_p50": statistics.median(step_ms),
        "step_ms_p99": pct(step_ms, 99),
        "decode_tok_s": decoded / decode_s,
        "e2e_tok_s": bs * new_tokens / total,
        "weight_gb_s": weight_bytes(llm) / (statistics.median(step_ms) / 1e3) / 1e9,
        **speculation(before, llm.stats()),
    }


def throughput_run(llm: LLM, num_requests: int, seed: int, sampling: dict, workload=None):
    prompts, out_lens = workload or throughput_workload(num_requests, seed, llm.config.vocab_size)
    params = [SamplingParams(ignore_eos=True, max_tokens=n, **sampling) for n in out_lens]
    llm.generate([[1] * 16], SamplingParams(max_tokens=4))  # warm-up call
    if llm.runner.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync(llm)
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    total = time.perf_counter() - start
    after = llm.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    ttft = [o.metrics["ttft_s"] * 1e3 for o in outputs]
    tpot = [
        (o.metrics["latency_s"] - o.metrics["ttft_s"]) * 1e3 / (len(o.token_ids) - 1)
        for o in outputs
    ]
    out_tokens = sum(len(o.token_ids) for o in outputs)
    peak = torch.cuda.max_memory_allocated() if llm.runner.device.type == "cuda" else 0
    return {
        "requests": num_requests,
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": out_tokens,
        "total_s": total,
        "output_tok_s": out_tokens / total,
        **{f"ttft_ms_p{q}": pct(ttft, q) for q in (50, 90, 99)},
        **{f"tpot_ms_p{q}": pct(tpot, q) for q in (50, 90, 99)},
        "peak_gpu_mem_gib": peak / 2**30,
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "swaps": after["num_swaps"] - before["num_swaps"],
        "host_tier_hit_tokens": after["prefix_cache_host_hits"] - before["prefix_cache_host_hits"],
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        **speculation(before, after),
    }
