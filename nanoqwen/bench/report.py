"""The benchmark's result tables, printed as Markdown."""

from __future__ import annotations


def print_table(title: str, rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (header, key in the row, format spec); a row without the key shows '-', and a
    column no row has is left out (with its unnamed continuation columns)."""
    kept, keep = [], False
    for header, key, spec in columns:
        keep = keep if not header else any(key in row for row in rows)
        if keep:
            kept.append((header, key, spec))
    columns = kept
    print(f"\n{title}")
    print(" | ".join(h for h, _, _ in columns))
    print(" | ".join("---" for _ in columns))
    for row in rows:
        cells = [format(row[k], f) if k in row else "-" for _, k, f in columns]
        print(" | ".join(cells))


def latency_columns(first_preset: str) -> list[tuple[str, str, str]]:
    return [
        ("bs", "batch_size", "d"), ("sampling", "sampling", "s"),
        (f"x {first_preset}", "x_first", ".3f"), ("TTFT ms", "ttft_ms", ".1f"),
        ("prefill tok/s", "prefill_tok_s", ",.0f"),
        ("step ms p50", "step_ms_p50", ".3f"), ("p99", "step_ms_p99", ".3f"),
        ("decode tok/s", "decode_tok_s", ",.0f"), ("e2e tok/s", "e2e_tok_s", ",.0f"),
        ("weights GB/s", "weight_gb_s", ",.0f"), ("HF tok/s", "hf_tok_s", ",.1f"),
        ("x HF", "x_hf", ".1f"),
        ("spec acceptance", "spec_acceptance_rate", ".1%"),
        ("spec mean accepted length", "spec_mean_accepted_length", ".2f"),
    ]  # fmt: skip


THROUGHPUT_COLUMNS = [
    ("output tok/s", "output_tok_s", ",.0f"), ("total s", "total_s", ".2f"),
    ("TTFT p50/p90/p99 ms", "ttft_ms_p50", ".0f"), ("", "ttft_ms_p90", ".0f"),
    ("", "ttft_ms_p99", ".0f"), ("TPOT p50/p90/p99 ms", "tpot_ms_p50", ".2f"),
    ("", "tpot_ms_p90", ".2f"), ("", "tpot_ms_p99", ".2f"),
    ("peak GiB", "peak_gpu_mem_gib", ".1f"), ("preemptions", "preemptions", "d"),
    ("swaps", "swaps", "d"), ("host-tier hit tokens", "host_tier_hit_tokens", "d"),
    ("prefix hit rate", "prefix_cache_hit_rate", ".1%"),
    ("HF tok/s", "hf_output_tok_s", ",.0f"),
    ("x HF", "x_hf", ".1f"),
    ("spec acceptance", "spec_acceptance_rate", ".1%"),
    ("spec mean accepted length", "spec_mean_accepted_length", ".2f"),
]  # fmt: skip


LONG_CONTEXT_COLUMNS = [
    ("prompt", "prompt_len", "d"), ("TTFT ms", "ttft_ms", ",.0f"),
    ("decode tok/s", "decode_tok_s", ",.1f"), ("streams", "streams", "d"),
    ("TTFT ms with streams", "ttft_ms_with_streams", ",.0f"),
    ("stream ITL ms p50 before", "itl_ms_p50_before", ".2f"),
    ("p50 / p99 / max during", "itl_ms_p50_during", ".2f"), ("", "itl_ms_p99_during", ".2f"),
    ("", "itl_ms_max_during", ".2f"),
    ("p99 during / p50 before", "itl_p99_during_over_p50_before", ".2f"),
]  # fmt: skip
