"""Swapping and the host tier on CUDA: pinned host pool, side-stream copies, and a swap-heavy
run (a KV pool sized for a quarter of the batch) whose outputs equal an unconstrained run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import write_tiny_model
from stress_workload import compare, make_workload, run

from nanoqwen import LLM
from nanoqwen.runtime.kv.cache import KVCache
from nanoqwen.runtime.kv.host_pool import HostKVCache

VOCAB = 512
NEAR_TIE = 1e-4  # float32 on the GPU, TF32 off


def test_side_stream_copies_wait_for_the_writes_before_them():
    cfg = SimpleNamespace(num_hidden_layers=4, num_key_value_heads=2, head_dim=64)
    kv = KVCache.allocate(cfg, 64, 16, torch.bfloat16, "cuda")
    host = HostKVCache(kv, 64)
    assert host.k.is_pinned()
    blocks = [3, 4, 5, 40, 9]
    for _ in range(3):
        # A slow kernel, then the write the copy must see: both queued, nothing waited for.
        a = torch.randn(4096, 4096, device="cuda")
        (a @ a).sum()
        kv.k_pool[:, blocks] = 7.0
        kv.v_pool[:, blocks] = -7.0
        host.copy_out(blocks, [10, 11, 12, 0, 1])
        kv.k_pool.zero_()  # must not reach the host copy
        kv.v_pool.zero_()
        host.copy_in([10, 11, 12, 0, 1], [20, 21, 22, 23, 24])
        torch.cuda.synchronize()
        assert bool((kv.k_pool[:, 20:25] == 7.0).all()) and bool(
            (kv.v_pool[:, 20:25] == -7.0).all()
        )
        assert float(kv.k_pool[:, :20].abs().sum()) == 0.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("swap-gpu-qwen2")
    write_tiny_model(path, vocab_size=VOCAB, hidden_size=64, max_position_embeddings=256)
    return str(path)


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_swap_heavy_run_equals_an_unconstrained_run(checkpoint, mode, caching):
    torch.backends.cuda.matmul.allow_tf32 = False
    requests = make_workload(512, VOCAB, seed=1, system_len=(60, 100), max_tokens=(16, 64))
    common = dict(device="cuda", dtype="float32", block_size=16, max_num_seqs=128, progress=False)
    ref = LLM(checkpoint, num_kv_blocks=8192, enable_prefix_caching=False, **common)
    expected = run(ref, requests, aborts=False)
    assert ref.stats()["num_preemptions"] == 0
    # 128 running sequences need about 128 x 7 blocks; the pool holds a quarter of that.
    llm = LLM(
        checkpoint,
        num_kv_blocks=224,
        preemption_mode=mode,
        enable_prefix_caching=caching,
        swap_space=0.25,
        **common,
    )
    results = run(llm, requests, aborts=True)
    c = compare(requests, results, expected, ref, NEAR_TIE)
    stats = llm.stats()
    print(f"\n{mode}, prefix caching {caching}: {c} {stats}")
    assert stats["num_preemptions"] >= 50
    assert (stats["num_swaps"] > 0) == (mode == "swap")
    blocks = llm.scheduler.blocks
    assert blocks.num_free_blocks == 224 and set(blocks.pool.ref_count) == {0}
    assert set(blocks.host_pool.ref_count) == {0}
