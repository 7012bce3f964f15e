"""`nanoqwen bench --mode long`'s measurement on the tiny model: streams keep producing while
the long prompt prefills in chunks, and the row holds every figure the table prints."""

from __future__ import annotations

import math
import random

from nanoqwen import LLM
from nanoqwen.bench.long_context import long_context_run
from nanoqwen.bench.report import LONG_CONTEXT_COLUMNS


def test_streams_produce_tokens_through_the_long_prefill(tiny_model):
    llm = LLM(str(tiny_model[0]), block_size=16, num_kv_blocks=128,
              max_num_batched_tokens=64, progress=False)  # fmt: skip
    row = long_context_run(llm, 600, 3, 8, random.Random(0), {"temperature": 0.0})
    # 600 tokens at 61 a step beside 3 decodes: 10 steps, each giving every stream a token.
    assert row["stream_tokens_during"] >= 3 * (600 // 61)
    for _, key, _ in LONG_CONTEXT_COLUMNS:
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert llm.scheduler.blocks.num_free_blocks == llm.scheduler.blocks.num_blocks
    assert not llm.scheduler.has_unfinished()
