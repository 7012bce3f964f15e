"""Scheduler: prompts beside running decodes, limits, chunked prefill, preemption, freeing,
no deadlock.

Most tests drive the scheduler alone, standing in for the engine with `advance` (which does
what LLM.step does with a batch); the last ones run a real LLM on a tiny model."""

from __future__ import annotations

import random

import pytest

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.kv.block_manager import BlockManager
from nanoqwen.runtime.scheduler import Batch, Scheduler, SchedulerConfig
from nanoqwen.runtime.sequence import Sequence, SequenceStatus

NEXT_TOKEN = 7


def make_scheduler(
    num_blocks=64, block_size=4, max_num_seqs=256, max_num_batched_tokens=8192, caching=False
):
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens), blocks)


def add(sched: Scheduler, prompt_len: int, max_tokens: int = 16) -> Sequence:
    seq = Sequence(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))
    sched.add(seq)
    return seq


def advance(sched: Scheduler, batch: Batch, max_len: int | None = None) -> list[Sequence]:
    """What LLM.step does after the model ran: count the computed tokens, give each
    completing sequence a token, finish those at max_tokens (or max_len)."""
    completed = [s for i, s in enumerate(batch.seqs) if batch.completes(i)]
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
    for seq in completed:
        seq.token_ids.append(NEXT_TOKEN)
        if seq.num_output_tokens >= seq.params.max_tokens or (max_len and len(seq) >= max_len):
            sched.finish(seq, "length")
    return completed


def step(sched: Scheduler, **kwargs) -> Batch:
    batch = sched.schedule()
    assert batch is not None
    advance(sched, batch, **kwargs)
    return batch


def test_nothing_to_do():
    sched = make_scheduler()
    assert sched.schedule() is None
    assert not sched.has_unfinished()


def test_a_short_prompt_prefills_alone_and_a_long_one_beside_the_running_decodes():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = add(sched, 5)
    b1 = step(sched)
    assert b1.is_prefill and b1.seqs == [a] and b1.num_new_tokens == [5]
    assert a.status is SequenceStatus.RUNNING and a.num_computed_tokens == 5 and len(a) == 6
    b = add(sched, 7)  # 7 = 8 - 1 running: one step of its own
    b2 = step(sched)
    assert b2.is_prefill and b2.seqs == [b] and b2.num_new_tokens == [7]
    c = add(sched, 10)  # needs chunks: they go beside a's and b's next tokens
    b3 = sched.schedule()
    assert b3.is_prefill and b3.seqs == [a, b, c] and b3.num_new_tokens == [1, 1, 6]
    assert [b3.completes(i) for i in range(3)] == [True, True, False]
    advance(sched, b3)
    b4 = step(sched)  # the rest of c, still beside them
    assert b4.seqs == [a, b, c] and b4.num_new_tokens == [1, 1, 4]
    b5 = step(sched)
    assert not b5.is_prefill
    assert b5.seqs == [a, b, c] and b5.num_new_tokens == [1, 1, 1]
    assert a.output_token_ids == [NEXT_TOKEN] * 4 and c.output_token_ids == [NEXT_TOKEN] * 2


def test_prefill_batches_several_prompts_in_arrival_order():
    sched = make_scheduler()
    seqs = [add(sched, n) for n in (3, 9, 1)]
    batch = step(sched)
    assert batch.is_prefill and batch.seqs == seqs and batch.num_new_tokens == [3, 9, 1]
    assert sched.running == seqs and not sched.waiting


def test_max_num_seqs_caps_running_sequences():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [add(sched, 3, max_tokens=3) for _ in range(5)]
    b1 = step(sched)
    assert b1.is_prefill and b1.seqs == seqs[:2]
    b2 = step(sched)  # two running: no room to admit, so decode
    assert not b2.is_prefill and b2.seqs == seqs[:2]
    step(sched)  # both reach max_tokens=3 and finish
    assert seqs[0].is_finished and seqs[1].is_finished
    b4 = step(sched)
    assert b4.is_prefill and b4.seqs == seqs[2:4]
    while sched.has_unfinished():
        batch = step(sched)
        assert len(batch.seqs) <= 2
        assert len(sched.running) <= 2
    assert all(s.is_finished for s in seqs)


def test_max_num_batched_tokens_caps_prefill_and_splits_the_last_prompt():
    sched = make_scheduler(max_num_batched_tokens=10)
    a, b, c, d = (add(sched, 4) for _ in range(4))
    b1 = sched.schedule()
    assert b1.is_prefill and b1.seqs == [a, b, c] and b1.num_new_tokens == [4, 4, 2]
    assert [b1.completes(i) for i in range(3)] == [True, True, False]
    advance(sched, b1)
    # The partial prompt stays at the head of the queue, holding its blocks.
    assert list(sched.waiting) == [c, d] and sched.running == [a, b]
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 2
    assert len(c.block_table) == 1 and len(c) == 4 and c.output_token_ids == []
    # c fits in a step beside a and b, so it needs no chunks: the budget cut it, and it
    # finishes in a prefill step of its own (with d), not beside a's and b's next tokens.
    b2 = sched.schedule()
    assert b2.is_prefill and b2.seqs == [c, d] and b2.num_new_tokens == [2, 4]
    assert [b2.completes(i) for i in range(2)] == [True, True]
    advance(sched, b2)
    assert sched.running == [a, b, c, d] and not sched.waiting


def _mixed(batch: Batch) -> bool:
    """Whether batch (scheduled, not yet advanced) holds running sequences' next tokens
    beside prompt tokens."""
    decodes = [s.num_output_tokens > 0 for s in batch.seqs]
    return batch.is_prefill and any(decodes) and not all(decodes)


def test_a_burst_of_prompts_that_each_fit_in_a_step_runs_no_mixed_step():
    """pair.py's throughput workload in small: the budget cuts a prompt at the end of each
    prefill step; the rest of it goes in the next prefill step, so every step is a prefill
    or a decode (mixed steps run eagerly, and these would finish no request sooner)."""
    sched = make_scheduler(num_blocks=256, max_num_batched_tokens=40)  # 40 - 20 >= 12
    rng = random.Random(0)
    seqs = [add(sched, rng.randint(3, 12), max_tokens=rng.randint(2, 12)) for _ in range(20)]
    kinds = []
    while sched.has_unfinished():
        batch = sched.schedule()
        assert not _mixed(batch)
        advance(sched, batch)
        kinds.append(batch.is_prefill)
    assert all(s.is_finished for s in seqs)
    assert kinds.index(False) > 1 and all(not k for k in kinds[kinds.index(False) :])


def test_a_long_prompt_mixes_to_its_last_chunk_and_a_short_one_cut_after_it_does_not():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = add(sched, 2, max_tokens=32)
    step(sched)
    long = add(sched, 10)
    short = add(sched, 5)
    b1 = step(sched)
    assert b1.seqs == [a, long] and b1.num_new_tokens == [1, 7]
    b2 = step(sched)  # long's last chunk, still beside a; the budget cuts short
    assert b2.seqs == [a, long, short] and b2.num_new_tokens == [1, 3, 4]
    b3 = step(sched)  # short fits beside a and long: the rest of it prefills alone
    assert b3.is_prefill and b3.seqs == [short] and b3.num_new_tokens == [1]
    b4 = step(sched)
    assert not b4.is_prefill and b4.seqs == [a, long, short]


def test_chunked_prefill_keeps_the_partial_prompt_at_the_head():
    sched = make_scheduler(max_num_batched_tokens=16)
    long = add(sched, 50)
    short = add(sched, 3)
    chunks = []
    while long.num_computed_tokens < 50:
        assert sched.waiting[0] is long
        batch = step(sched)
        assert batch.is_prefill and batch.seqs[0] is long
        assert sum(batch.num_new_tokens) <= 16
        chunks.append(batch.num_new_tokens)
    assert chunks == [[16], [16], [16], [2, 3]]
    # Sampled exactly once, when its last prompt token was computed.
    assert long.output_token_ids == [NEXT_TOKEN] and short.output_token_ids == [NEXT_TOKEN]
    assert sched.running == [long, short]


def test_running_sequences_keep_decoding_while_a_prompt_is_chunked():
    """The budget holds the running sequences' tokens first, the prompt's chunks the rest:
    no step of a long prefill leaves a running stream without its next token."""
    sched = make_scheduler(max_num_batched_tokens=8)
    a = add(sched, 2, max_tokens=32)
    step(sched)
    b = add(sched, 20)
    batches = [step(sched) for _ in range(3)]
    assert [bt.seqs for bt in batches] == [[a, b], [a, b], [a, b]]
    assert [bt.num_new_tokens for bt in batches] == [[1, 7], [1, 7], [1, 6]]
    # b samples once, after its last chunk; a once a step.
    assert len(a.output_token_ids) == 4 and len(b.output_token_ids) == 1
    decode = step(sched)
    assert not decode.is_prefill and decode.seqs == [a, b]


def test_running_sequences_past_the_budget_leave_no_room_for_prompts():
    sched = make_scheduler(max_num_batched_tokens=3)
    running = [add(sched, 1, max_tokens=8) for _ in range(3)]
    step(sched)
    waiting = add(sched, 4)
    batch = step(sched)
    assert not batch.is_prefill and batch.seqs == running
    assert list(sched.waiting) == [waiting]


def test_preemption_evicts_the_newest_and_requeues_it_first():
    # 3 blocks of 4: a (4-token prompt), b and c (2 tokens) fill the pool after prefill.
    sched = make_scheduler(num_blocks=3, block_size=4)
    a, b, c = add(sched, 4), add(sched, 2), add(sched, 2)
    step(sched)
    assert sched.blocks.num_free_blocks == 0
    d = add(sched, 4)  # arrives while the pool is full: cannot be admitted
    batch = step(sched)
    # a's 5th token needs a second block: c, the newest, is evicted; b still fits.
    assert not batch.is_prefill and batch.seqs == [a, b]
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [c, d]
    assert c.status is SequenceStatus.WAITING
    assert c.num_computed_tokens == 0 and c.block_table == []
    assert c.output_token_ids == [NEXT_TOKEN]  # generated tokens survive, to be recomputed
    assert len(a.block_table) == 2 and sched.running == [a, b]

    sched.finish(a, "stop")
    batch = step(sched)
    # c comes back first and recomputes its prompt and its generated token in one go; d
    # follows in the same step, and b decodes in the next.
    assert batch.is_prefill and batch.seqs == [c, d] and batch.num_new_tokens == [3, 4]
    assert c.output_token_ids == [NEXT_TOKEN, NEXT_TOKEN]


def test_preempting_several_keeps_their_arrival_order():
    # 4 blocks of 2: a (4-token prompt), b and c (2 tokens) fill the pool after prefill.
    sched = make_scheduler(num_blocks=4, block_size=2)
    a, b, c = add(sched, 4), add(sched, 2), add(sched, 2)
    step(sched)
    d = add(sched, 2)
    batch = step(sched)
    # a's 5th token takes c's block; then b cannot grow and is the newest left: it goes too.
    assert not batch.is_prefill and batch.seqs == [a]
    assert sched.num_preemptions == 2
    assert list(sched.waiting) == [b, c, d]
    assert sched.running == [a] and sched.blocks.num_free_blocks == 1


def test_the_newest_sequence_preempts_itself_when_it_cannot_grow():
    sched = make_scheduler(num_blocks=3, block_size=2)
    a, b = add(sched, 2), add(sched, 2)
    step(sched)
    batch = step(sched)  # a takes the last free block; b, the newest, has none left
    assert batch.seqs == [a] and list(sched.waiting) == [b]
    assert sched.num_preemptions == 1 and b.block_table == []
    assert sched.blocks.num_free_blocks == 1


def test_finishing_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=8, block_size=4)
    a, b = add(sched, 9), add(sched, 4)
    step(sched)
    assert sched.blocks.num_free_blocks == 8 - 3 - 1
    sched.finish(a, "stop")
    assert a.is_finished and a.finish_reason == "stop"
    assert a.block_table == [] and sched.blocks.num_free_blocks == 8 - 1
    assert sched.running == [b]
    sched.finish(b, "length")
    assert sched.blocks.num_free_blocks == 8 and not sched.has_unfinished()


def test_aborting_a_partially_prefilled_prompt_frees_its_blocks():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=5)
    a = add(sched, 20)
    b = add(sched, 3)
    step(sched)
    assert sched.waiting[0] is a and len(a.block_table) == 5
    sched.finish(a, "abort")
    assert sched.blocks.num_free_blocks == 8 and list(sched.waiting) == [b]
    batch = step(sched)
    assert batch.seqs == [b] and batch.num_new_tokens == [3]


def test_a_cached_prefix_is_not_prefilled_again():
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=6, caching=True)
    a = add(sched, 10)
    assert [step(sched).num_new_tokens for _ in range(2)] == [[6], [4]]
    b = add(sched, 11)  # the first 8 tokens equal a's two full blocks
    batch = step(sched)
    assert batch.is_prefill and batch.seqs == [a, b] and batch.num_new_tokens == [1, 3]
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed_tokens == 11
    assert sched.blocks.stats.hits == 8 and sched.blocks.stats.queries == 21


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_finish_without_crash_or_leak(seed, caching):
    """Random prompts, limits and pool sizes: every batch obeys the limits, every scheduled
    token has a slot, a block is shared only through the prefix cache (its refcount counts
    its users), none is lost, and everything finishes."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    max_len = rng.randint(8, 40)
    num_blocks = -(-max_len // block_size) + rng.randint(0, 6)
    max_num_seqs = rng.randint(1, 6)
    budget = rng.randint(1, 24)
    sched = make_scheduler(num_blocks, block_size, max_num_seqs, budget, caching)
    seqs = [add(sched, rng.randint(1, max_len - 1), rng.randint(1, 30)) for _ in range(20)]
    steps = 0
    while sched.has_unfinished() and steps < 100_000:
        steps += 1
        batch = sched.schedule()
        assert batch is not None, "work is pending but nothing was scheduled"
        assert len(sched.running) <= max_num_seqs
        if batch.is_prefill:
            assert sum(batch.num_new_tokens) <= budget
            assert all(n >= 1 for n in batch.num_new_tokens)
        else:
            assert batch.num_new_tokens == [1] * len(batch.seqs)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert len(seq.block_table) * block_size >= seq.num_computed_tokens + n
        owned = [b for s in seqs for b in s.block_table]
        if not caching:
            assert len(owned) == len(set(owned))
        refs = sched.blocks.pool.ref_count
        assert all(refs[b] == owned.count(b) for b in range(num_blocks))
        assert len(set(owned)) + sched.blocks.num_free_blocks == num_blocks
        advance(sched, batch, max_len=max_len)
    assert all(s.is_finished for s in seqs), f"stuck after {steps} steps"
    assert sched.blocks.num_free_blocks == num_blocks
    assert set(sched.blocks.pool.ref_count) == {0}
    if caching:
        assert sched.blocks.stats.hits > 0
    for s in seqs:
        assert s.num_output_tokens == min(s.params.max_tokens, max_len - s.num_prompt_tokens)


# ---- a real engine ------------------------------------------------------------------------


def guard_steps(llm: LLM, limit: int) -> None:
    """Makes a stuck engine fail instead of looping forever inside generate()."""
    real_step = llm.step
    calls = 0

    def step():
        nonlocal calls
        calls += 1
        assert calls <= limit, f"no end after {limit} steps: the scheduler is stuck"
        return real_step()

    llm.step = step


def test_pool_for_one_max_length_sequence_does_not_deadlock(tiny_model):
    path, _ = tiny_model
    block_size, num_blocks = 4, 8
    llm = LLM(
        str(path),
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=12,
        progress=False,
    )
    max_len = llm.max_model_len
    assert max_len == block_size * num_blocks  # the pool holds one full-length sequence
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, max_len - 1))] for _ in range(12)]
    prompts.append(list(range(max_len - 1)))  # the longest prompt allowed
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    guard_steps(llm, 5000)
    outputs = llm.generate(prompts, params)
    assert llm.scheduler.num_preemptions > 0
    assert llm.scheduler.blocks.num_free_blocks == num_blocks
    assert not llm.scheduler.has_unfinished()
    for prompt, out in zip(prompts, outputs):
        assert len(prompt) + len(out.token_ids) == max_len
        assert out.finish_reason == "length"
    # Scheduling must not change greedy results: each prompt alone in a roomy pool.
    alone = LLM(str(path), block_size=block_size, num_kv_blocks=64, progress=False)
    for prompt, out in zip(prompts, outputs):
        solo = alone.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=len(out.token_ids), ignore_eos=True)
        )
        assert solo[0].token_ids == out.token_ids


def test_many_requests_through_a_tiny_pool(tiny_model):
    path, _ = tiny_model
    llm = LLM(str(path), block_size=2, num_kv_blocks=12, max_num_seqs=5, progress=False)
    prompts = [[(7 * i + j) % 512 for j in range(1 + i % 9)] for i in range(30)]
    guard_steps(llm, 5000)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [min(9, 24 - len(p)) for p in prompts]
    assert llm.scheduler.blocks.num_free_blocks == 12
    assert llm.scheduler.num_preemptions > 0
