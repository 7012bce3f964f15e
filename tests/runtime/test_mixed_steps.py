"""Mixed steps through the engine (tiny model, float32): a prompt that arrives while others
decode is prefilled in chunks beside their next tokens; every running stream gets a token
at every step of that prefill, and every request's output is what it is alone."""

from __future__ import annotations

from nanoqwen import LLM, SamplingParams

LONG_PROMPT = [(7 * i) % 500 + 3 for i in range(300)]
SHORT = [[5, 6, 7, 8], [40, 41, 42], [100, 200, 300, 301, 302]]


def engine(model_dir, **options) -> LLM:
    return LLM(str(model_dir), block_size=16, num_kv_blocks=64, progress=False, **options)


def test_running_streams_get_a_token_every_step_of_a_long_prefill(tiny_model):
    llm = engine(tiny_model[0], max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    streams = [llm.add_request(p, params) for p in SHORT]
    while any(s.num_output_tokens < 3 for s in streams):
        llm.step()
    long = llm.add_request(LONG_PROMPT, SamplingParams(temperature=0, max_tokens=5))
    chunks = 0
    while long.first_token_time is None:
        made = {seq.seq_id for seq, _ in llm.step()}
        chunks += 1
        assert all(s.seq_id in made for s in streams), "a running stream got no token"
    assert chunks >= 300 // 64  # the prompt took several steps, each one mixed
    while llm.scheduler.has_unfinished():
        llm.step()
    llm.drain()
    alone = engine(tiny_model[0])
    for seq, prompt in zip([*streams, long], [*SHORT, LONG_PROMPT]):
        want = alone.generate([prompt], seq.params)[0].token_ids
        assert seq.output_token_ids == want


def test_seeded_and_penalised_requests_keep_their_tokens_in_mixed_steps(tiny_model):
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=30, ignore_eos=True),
        SamplingParams(
            temperature=1.0, repetition_penalty=1.3, seed=6, max_tokens=30, min_tokens=10
        ),  # fmt: skip
        SamplingParams(temperature=0, presence_penalty=0.7, max_tokens=30, logprobs=2),
    ]
    llm = engine(tiny_model[0], max_num_batched_tokens=48)
    early = [llm.add_request(p, sp) for p, sp in zip(SHORT, params)]
    for _ in range(4):
        llm.step()
    late = [llm.add_request(LONG_PROMPT[: 100 + 50 * i], sp) for i, sp in enumerate(params)]
    while llm.scheduler.has_unfinished():
        llm.step()
    llm.drain()
    alone = engine(tiny_model[0])
    prompts = SHORT + [LONG_PROMPT[: 100 + 50 * i] for i in range(3)]
    for seq, prompt in zip(early + late, prompts):
        want = alone.generate([prompt], seq.params)[0]
        assert seq.output_token_ids == want.token_ids
    assert llm.scheduler.blocks.num_free_blocks == llm.scheduler.blocks.num_blocks


def test_only_a_prompt_longer_than_one_step_shares_steps_with_running_streams(tiny_model):
    """A prompt that fits in one step prefills alone (the decode steps around it keep their
    graphs); one that needs chunks goes beside the running streams' tokens."""
    llm = engine(tiny_model[0], max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    streams = [llm.add_request(p, params) for p in SHORT]
    while any(s.num_output_tokens < 2 for s in streams):
        llm.step()
    llm.drain()
    short = llm.add_request(LONG_PROMPT[:61], params)  # 61 = 64 - 3 running: fits
    batch = llm.scheduler.schedule()
    assert batch.is_prefill and batch.seqs == [short] and batch.num_new_tokens == [61]
    llm.abort([short])
    long = llm.add_request(LONG_PROMPT[:62], params)
    batch = llm.scheduler.schedule()
    assert batch.is_prefill and batch.seqs == [*streams, long]
    assert batch.num_new_tokens == [1, 1, 1, 61]
    llm.abort([*streams, long])
