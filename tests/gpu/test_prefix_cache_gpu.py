"""Prefix-cache hits on the GPU backends: prompts that share a long prefix prefill only their
own tokens, with CUDA graphs on, and generate what they generate without the cache."""

from __future__ import annotations

import random

import pytest
from conftest import write_tiny_model

from nanoqwen import LLM, SamplingParams

VOCAB = 512
PREFIX, OWN, NEW = 600, 24, 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("prefix-gpu-qwen2")
    # head_dim 64: what the Triton kernels serve.
    write_tiny_model(
        path,
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    return str(path)


@pytest.mark.parametrize(
    ("backend", "block_size"),
    [("triton", 16), ("triton", 256), ("flash-attn", 256), ("torch", 16)],
)
def test_shared_prefix_hits_generate_what_a_cold_run_does(checkpoint, backend, block_size):
    if backend == "flash-attn":
        pytest.importorskip("flash_attn")
    rng = random.Random(0)
    prefix = [rng.randrange(VOCAB) for _ in range(PREFIX)]
    prompts = [prefix + [rng.randrange(VOCAB) for _ in range(OWN)] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    common = dict(
        device="cuda", dtype="bfloat16", attention_backend=backend, block_size=block_size,
        num_kv_blocks=4096 // block_size * 8, progress=False,
    )  # fmt: skip
    cold = LLM(checkpoint, enable_prefix_caching=False, **common)
    expected = [o.token_ids for o in cold.generate(prompts, params)]
    warm = LLM(checkpoint, **common)
    first = warm.generate(prompts[:1], params)[0].token_ids
    rest = [o.token_ids for o in warm.generate(prompts[1:], params)]
    stats = warm.stats()
    # The seven later prompts find every full block of the prefix.
    assert stats["prefix_cache_hits"] >= 7 * (PREFIX // block_size) * block_size
    got = [first, *rest]
    same = sum(g == e for g, e in zip(got, expected))
    print(f"\n{backend} block {block_size}: {same}/8 prompts equal, {stats}")
    # bfloat16: a different batch shape may flip a near-tie; wrong K/V would change them all.
    assert same >= 6
    assert all(g[0] == e[0] for g, e in zip(got, expected))
