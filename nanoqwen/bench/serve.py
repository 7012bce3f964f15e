"""The serving benchmark: requests with Poisson arrivals (or all at once) against a running
`nanoqwen serve`, and the same requests through the offline engine for comparison.

    python -m nanoqwen.bench.serve --base-url http://127.0.0.1:8000 --request-rate 8
    python -m nanoqwen.bench.serve --offline --random-shape 0.5B --json offline.json

Reports what vLLM's serving benchmark reports: request throughput, output tok/s, and TTFT,
TPOT (per request: (e2e - TTFT) / (output tokens - 1)), ITL (the gaps between streamed
chunks) and end-to-end latency at p50/p90/p99. Prompts are random token ids, sent as ids with
ignore_eos, so every request makes exactly its output length, with a tokenizer or without
(random weights). With the default lengths the workload is `nanoqwen bench`'s throughput
workload (256 requests, prompts and outputs uniform in [100, 1024] tokens)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass

import numpy as np

from nanoqwen.bench.serve_client import (
    RequestResult,
    default_client_processes,
    one_request,
    send_requests,
)
from nanoqwen.runtime.config_flags import add_engine_flags, engine_config
from nanoqwen.runtime.engine import LLM
from nanoqwen.runtime.sampling_params import SamplingParams


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(
    num_requests: int,
    prompt_lens: tuple[int, int] = (100, 1024),
    output_lens: tuple[int, int] = (100, 1024),
    max_token_id: int = 10000,
    seed: int = 0,
) -> Workload:
    """All prompts drawn first, then all output lengths: with the defaults the same requests
    as nanoqwen.bench.workloads.throughput_workload."""
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, max_token_id) for _ in range(rng.randint(*prompt_lens))]
        for _ in range(num_requests)
    ]
    return Workload(prompts, [rng.randint(*output_lens) for _ in range(num_requests)])


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start: a Poisson process of `rate` requests/s; inf: all at 0."""
    if rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, n)).tolist()


async def run_online(args: argparse.Namespace, work: Workload) -> dict:
    import httpx

    base = args.base_url.rstrip("/")
    url = f"{base}/v1/completions"
    async with httpx.AsyncClient(timeout=None) as client:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = (
            args.model_name
            or (await client.get(f"{base}/v1/models", headers=headers)).json()["data"][0]["id"]
        )
        bodies = [
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": n,
                "temperature": args.temperature,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            for prompt, n in zip(work.prompts, work.output_lens)
        ]
        await one_request(client, url, {**bodies[0], "max_tokens": 4}, args.api_key)
    times = arrival_times(len(bodies), args.request_rate, args.seed)
    results, duration = await asyncio.to_thread(
        send_requests, url, args.api_key, bodies, times, args.client_processes,
        args.max_concurrency,
    )  # fmt: skip
    return summarize(results, duration, work, args)


def _percentiles(name: str, values_s: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1e3
    if ms.size == 0:
        return {f"{name}_ms_{k}": float("nan") for k in ("mean", "p50", "p90", "p99")}
    return {
        f"{name}_ms_mean": float(ms.mean()),
        **{f"{name}_ms_p{q}": float(np.percentile(ms, q)) for q in (50, 90, 99)},
    }


def summarize(
    results: list[RequestResult], duration: float, work: Workload, args: argparse.Namespace
) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "mode": "online",
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors[:5],
        "duration_s": duration,
        "prompt_tokens": sum(len(p) for p, r in zip(work.prompts, results) if r.ok),
        "output_tokens": out_tokens,
        "output_chunks": sum(len(r.itl) + 1 for r in done),  # below output_tokens: coalesced
        "request_throughput": len(done) / duration,
        "output_tok_s": out_tokens / duration,
        **_percentiles("ttft", [r.ttft for r in done]),
        **_percentiles("tpot", tpot),
        **_percentiles("itl", [gap for r in done for gap in r.itl]),
        **_percentiles("e2e", [r.e2e for r in done]),
    }


def run_offline(args: argparse.Namespace, work: Workload) -> dict:
    """The same requests through LLM.generate in this process: the ceiling to compare with."""
    model = None if args.random_shape else args.model
    llm = LLM(config=engine_config(args, model=model, progress=not args.quiet))
    params = [
        SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n)
        for n in work.output_lens
    ]
    llm.generate([work.prompts[0]], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(work.prompts, params)
    duration = time.perf_counter() - start
    out_tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "mode": "offline",
        "num_requests": len(outputs),
        "duration_s": duration,
        "output_tokens": out_tokens,
        "request_throughput": len(outputs) / duration,
        "output_tok_s": out_tokens / duration,
        **_percentiles("ttft", [o.metrics["ttft_s"] for o in outputs]),
        **_percentiles("e2e", [o.metrics["latency_s"] for o in outputs]),
    }


def _print_report(result: dict) -> None:
    print(f"\n{result['mode']} serving benchmark")
    for key, value in result.items():
        if key in ("mode", "errors"):
            continue
        shown = f"{value:,.2f}" if isinstance(value, float) else value
        print(f"  {key:24s} {shown}")
    for error in result.get("errors", []):
        print(f"  error: {error}")


def _span(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m nanoqwen.bench.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    engine = p.add_argument_group("engine (--offline)")
    add_engine_flags(engine)
    add_engine_flags(engine, names=("random_shape",))
    engine.add_argument("-q", "--quiet", action="store_true", help="no engine log")
    g = p.add_argument_group("benchmark")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="the running server")
    g.add_argument("--api-key", help="the server's --api-key")
    g.add_argument("--model-name", help="model name to send (default: the server's)")
    g.add_argument("--num-requests", type=int, default=256)
    g.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s, Poisson arrivals; inf (default): a burst, all at once",
    )
    g.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    g.add_argument(
        "--client-processes",
        type=int,
        default=default_client_processes(),
        help="processes sending the requests, so that parsing the streams does not limit the "
        "figures (default: a quarter of the cores, 1 to 4)",
    )
    g.add_argument("--prompt-len", type=_span, default=(100, 1024), help="LOW:HIGH tokens")
    g.add_argument("--output-len", type=_span, default=(100, 1024), help="LOW:HIGH tokens")
    g.add_argument("--max-token-id", type=int, default=10000, help="prompt ids in 0..this")
    g.add_argument("--temperature", type=float, default=0.6)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", dest="json_path", help="write the result to this file")
    g.add_argument(
        "--offline",
        action="store_true",
        help="run the requests through LLM.generate in this process instead (engine flags "
        "as for `nanoqwen serve`)",
    )
    g.add_argument(
        "--compare",
        metavar="OFFLINE_JSON",
        help="an --offline result: print the online/offline ratio",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    work = make_workload(
        args.num_requests, args.prompt_len, args.output_len, args.max_token_id, args.seed
    )
    result = run_offline(args, work) if args.offline else asyncio.run(run_online(args, work))
    if args.compare:
        with open(args.compare) as f:
            offline = json.load(f)
        result["offline_output_tok_s"] = offline["output_tok_s"]
        result["x_offline"] = result["output_tok_s"] / offline["output_tok_s"]
    _print_report(result)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result.get("failed", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
