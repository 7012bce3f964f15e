"""A float8 KV cache on the GPU (random weights of the 0.5B shape, bfloat16, Triton
attention): the same memory holds twice the blocks, CUDA-graph decode gives the eager
tokens, and teacher-forced logits stay close to the bfloat16 cache's."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from nanoqwen import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def engine(**options) -> LLM:
    return LLM(random_shape="0.5B", device="cuda", block_size=16, gpu_memory_utilization=0.3,
               progress=False, **options)  # fmt: skip


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10000) for _ in range(rng.randint(40, 400))] for _ in range(8)]


def test_twice_the_blocks_graphs_equal_eager_and_logits_stay_close(prompts):
    fp8 = engine(kv_cache_dtype="fp8")
    fp8_blocks = fp8.scheduler.blocks.num_blocks
    graphed = [o.token_ids for o in fp8.generate(prompts, GREEDY)]
    fp8_logits = [fp8.runner.prompt_logits(p) for p in prompts]
    del fp8
    gc.collect()  # its graphs and pools, before the next engine sizes its pool
    torch.cuda.empty_cache()
    eager = engine(kv_cache_dtype="fp8", enforce_eager=True)
    assert [o.token_ids for o in eager.generate(prompts, GREEDY)] == graphed
    del eager
    gc.collect()
    torch.cuda.empty_cache()
    bf16 = engine()
    assert 1.9 <= fp8_blocks / bf16.scheduler.blocks.num_blocks <= 2.1
    for p, lf in zip(prompts, fp8_logits):
        lb = bf16.runner.prompt_logits(p)
        diff = (lf.log_softmax(-1) - lb.log_softmax(-1)).abs()
        assert diff.mean() < 0.05, diff.mean()
        assert (lf.argmax(-1) == lb.argmax(-1)).float().mean() > 0.9
