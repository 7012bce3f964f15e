"""tensor_parallel_size=2 on the CPU (gloo, two processes) against one process, on the same
tiny checkpoint: greedy tokens, logprobs, the prefix cache and preemption by swapping."""

from __future__ import annotations

import pytest
import torch
from conftest import write_tiny_model

from nanoqwen import LLM, SamplingParams

# Engines small enough that the preemption test runs out of KV blocks (8 blocks of 8 tokens).
ENGINE = dict(block_size=8, num_kv_blocks=8, max_num_seqs=4, swap_space=0.01, progress=False)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
NEAR_TIE = 1e-4  # float32: the two ranks sum o_proj/down_proj partials in another order


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(one-process engine, two-rank engine) of a tiny model whose vocabulary (509) does not
    split evenly, so the last rank's vocabulary shard is padded."""
    path = tmp_path_factory.mktemp("tiny-tp")
    write_tiny_model(path, vocab_size=509)
    single = LLM(str(path), **ENGINE)
    split = LLM(str(path), tensor_parallel_size=2, **ENGINE)
    yield single, split
    split.close()


def assert_same_greedy(single: LLM, prompt: list[int], a: list[int], b: list[int]) -> None:
    """Equal tokens, or a first divergence where single's top-2 logits tie to float noise."""
    if a == b:
        return
    i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    logits = single.runner.prompt_logits(prompt + a[:i], last=1)[0]
    top2 = logits.topk(2)
    gap = (top2.values[0] - top2.values[1]).item()
    assert gap < NEAR_TIE and b[i] in top2.indices.tolist(), (
        f"outputs diverge at token {i} ({a[i]} vs {b[i]}) where the logits differ by {gap}"
    )


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 509, (length,), generator=gen).tolist() for _ in range(n)]


def test_greedy_tokens_and_logprobs_match_one_process(engines):
    single, split = engines
    batch = [[1, 2, 3], [507, 508, 254, 255, 256], *prompts(0, 2, 13)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)  # fmt: skip
    want, got = single.generate(batch, params), split.generate(batch, params)
    for prompt, w, g in zip(batch, want, got):
        assert_same_greedy(single, prompt, w.token_ids, g.token_ids)
        if w.token_ids == g.token_ids:
            for lw, lg in zip(w.logprobs, g.logprobs):
                assert lg.logprob == pytest.approx(lw.logprob, abs=1e-4)
                assert [t for t, _ in lg.top] == [t for t, _ in lw.top]
        for pw, pg in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            assert pg.logprob == pytest.approx(pw.logprob, abs=1e-4)


def test_teacher_forced_logits_match_one_process(engines):
    single, split = engines
    prompt = prompts(1, 1, 40)[0]
    want = single.runner.prompt_logits(prompt)
    got = split.runner.prompt_logits(prompt)
    assert got.shape == (40, 509)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_prefix_cache_hits_with_two_ranks(engines):
    single, split = engines
    shared = prompts(2, 1, 24)[0]  # three full blocks
    batch = [shared + [5, 6], shared + [7]]
    for engine in engines:
        engine.generate(batch[:1], GREEDY)
    before = split.stats()["prefix_cache_hits"]
    want, got = single.generate(batch, GREEDY), split.generate(batch, GREEDY)
    assert split.stats()["prefix_cache_hits"] - before >= 2 * 24
    for prompt, w, g in zip(batch, want, got):
        assert_same_greedy(single, prompt, w.token_ids, g.token_ids)


def test_preemption_by_swapping_with_two_ranks(engines):
    """Four sequences of 20 + 20 tokens need 20 blocks of the 8 there are: sequences are
    swapped out to the host pool and back, on every rank's KV shard."""
    single, split = engines
    batch = prompts(3, 4, 20)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    swaps = split.stats()["num_swaps"]
    want, got = single.generate(batch, params), split.generate(batch, params)
    assert split.stats()["num_swaps"] > swaps
    assert split.stats()["num_swaps"] == single.stats()["num_swaps"]
    for prompt, w, g in zip(batch, want, got):
        assert_same_greedy(single, prompt, w.token_ids, g.token_ids)
