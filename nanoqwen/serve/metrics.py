"""Prometheus metrics of the server, named like vLLM's `vllm:` ones under `nanoqwen:`.

The engine loop updates them (gauges once per step); GET /metrics renders them."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from nanoqwen.serve.messages import EngineStats

# Seconds: from a few ms (a GPU decode step) to minutes (a long answer on the CPU).
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class ServingMetrics:
    def __init__(self, model_name: str) -> None:
        # A registry of its own, so several servers (tests) can live in one process.
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"nanoqwen:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"nanoqwen:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"nanoqwen:{name}", doc, labels, buckets=buckets, registry=r).labels(
                model_name
            )

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.kv_free = gauge("kv_cache_free_blocks", "KV-cache blocks free.")
        self.kv_total = gauge("kv_cache_total_blocks", "KV-cache blocks in the pool.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (recomputed later).")
        self._finished = Counter(
            "nanoqwen:request_success",
            "Sequences finished, by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._model_name = model_name
        self.ttft = histogram(
            "time_to_first_token_seconds", "From arrival to the first token.", _LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "Per sequence: (end - first token) / (output tokens - 1).",
            _LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "From arrival to the last token.", _LATENCY_BUCKETS
        )
        self.prompt_len = histogram("request_prompt_tokens", "Prompt tokens.", _TOKEN_BUCKETS)
        self.output_len = histogram(
            "request_generation_tokens", "Generated tokens per sequence.", _TOKEN_BUCKETS
        )
        # Speculative decoding, named as vLLM names them (acceptance rate: accepted tokens
        # over draft tokens; mean accepted length: 1 + accepted tokens over drafts).
        self.spec_drafts = counter(
            "spec_decode_num_drafts", "Sequence steps that checked proposed tokens."
        )
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Proposed tokens.")
        self.spec_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Proposed tokens accepted."
        )
        self._seen: dict[str, int] = {}

    def finished(self, reason: str) -> None:
        self._finished.labels(self._model_name, reason).inc()

    def set_engine_state(self, s: EngineStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_free.set(s.num_free_blocks)
        self.kv_total.set(s.num_blocks)
        self.kv_usage.set(1.0 - s.num_free_blocks / s.num_blocks)
        # The engine counts since its start; the counters move by what is new.
        for counter, name in (
            (self.preemptions, "num_preemptions"),
            (self.spec_drafts, "num_spec_verified"),
            (self.spec_draft_tokens, "num_spec_proposed"),
            (self.spec_accepted_tokens, "num_spec_accepted"),
        ):
            value = getattr(s, name)
            if value > self._seen.get(name, 0):
                counter.inc(value - self._seen.get(name, 0))
                self._seen[name] = value

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
