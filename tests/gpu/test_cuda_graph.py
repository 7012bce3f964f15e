"""CUDA-graph decode: same logits and tokens as eager, and no host sync inside a step, for
every sampling option."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import launch_two_steps_without_host_sync

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.prefill_graph import buckets
from nanoqwen.runtime.scheduler import Batch

pytest.importorskip("triton", reason="the Triton backend's graphs need triton")
from nanoqwen.attention import triton_backend  # noqa: E402


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    from conftest import write_tiny_model

    path = tmp_path_factory.mktemp("gpu-tiny")
    write_tiny_model(
        path,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        num_hidden_layers=3,
        vocab_size=1000,
    )
    return path


def _engine(path, backend: tuple[str, int, bool], **kw):
    name, block, flash = backend
    llm = LLM(
        str(path),
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=80,
        num_kv_blocks=80 * 256 // block,
        attention_backend=name,
        block_size=block,
        progress=False,
        **kw,
    )
    attention = llm.runner.model.layers[0].self_attn.backend
    assert attention.name == name
    if name == "triton":
        assert (attention.flash is not None) == flash
    return llm


# A batch that mixes every sampling option.
MIXED = [
    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05, max_tokens=8),
    SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=8, logprobs=3),
    SamplingParams(temperature=0.6, min_p=0.1, presence_penalty=0.4, frequency_penalty=0.3),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, min_tokens=4, stop_token_ids=[5]),
    SamplingParams(temperature=0.9, top_k=600, seed=9, max_tokens=8),  # top-k past candidates
]


def _decode_batch(llm: LLM, lengths: list[int], params=None) -> Batch:
    """Prefill sequences of the given lengths, then return the decode batch that follows."""
    params = params or [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    for i, n in enumerate(lengths):
        p = params[i % len(params)]
        llm._add([(7 * i + j) % 997 for j in range(n)], p, detokenize=False)
    while llm.scheduler.waiting:
        llm.step()
    return llm.scheduler.schedule()


# 70 sequences x 2 KV heads: the Triton decode kernel's large-batch tiles.
@pytest.mark.parametrize("batch", [1, 3, 17, 70])
def test_graph_replay_matches_eager(gpu_model, batch, backend):
    llm = _engine(gpu_model, backend)
    # Up to 600 tokens each, 200 for 70 sequences, so that the pool (80 x 256 tokens at
    # every block size) holds them and one prefill step (8,192 tokens) takes them all.
    lengths = [5 + 37 * i % (600 if batch < 32 else 200) for i in range(batch)]
    b = _decode_batch(llm, lengths)
    graphs = llm.runner.graphs
    key = graphs.key_for(batch, max(lengths) + 1, llm.runner.sampler.filtering)
    bs = key[0]
    assert bs >= batch
    # The batch's newest tokens are still on the device, in the prefill step's output, which
    # may live in the graphs' memory pool: the replay below reuses that memory, so the eager
    # re-run of the same step at the end takes them from a copy (an engine never runs a step
    # twice; it fills a step's tokens before the step's own replay).
    last_tokens = llm.runner._last_tokens.clone()
    graph_logits = llm.runner.compute_logits(b).clone()
    assert graph_logits.shape == (batch, 1000)
    # The same step run eagerly on the graph's own input buffers (the K/V write repeats
    # into the same slots) must give bit-identical logits.
    model = llm.runner.model
    with torch.inference_mode():
        eager = model.compute_logits(model(graphs.ids[:bs], graphs.meta[key]))[:batch]
    assert torch.equal(graph_logits, eager)
    # And the runner's own eager path (a narrower block table) picks the same tokens.
    llm.runner.graphs = None
    llm.runner._last_tokens = last_tokens
    assert torch.equal(llm.runner.compute_logits(b).argmax(-1), graph_logits.argmax(-1))


@pytest.mark.parametrize("batch", [1, 3])
def test_replays_of_one_step_give_the_same_logits(gpu_model, backend, batch):
    """At batch 1 the kernels start before the one in front of them has finished
    (kernels/triton/pdl.py) and must not read its output before it is complete: a race
    shows as logits that change from one replay of the same step to the next."""
    llm = _engine(gpu_model, backend)
    lengths = [300 + 37 * i for i in range(batch)]
    b = _decode_batch(llm, lengths)
    runner = llm.runner
    runner.compute_logits(b)  # fills the graph's input buffers for this step
    key = runner.graphs.key_for(batch, max(lengths) + 1, runner.sampler.filtering)
    first = runner.graphs.replay(key)[0].clone()
    for _ in range(50):
        # Each replay writes the step's K/V to the same slots with the same values.
        assert torch.equal(runner.graphs.replay(key)[0], first)


@pytest.mark.parametrize("params", [[p] for p in MIXED] + [MIXED], ids=[*map(str, range(6)), "all"])
def test_steps_have_no_host_sync(gpu_model, backend, params):
    """Prefill (slot admission included) and decode, with graphs and eager."""
    llm = _engine(gpu_model, backend)
    for graphs in (True, False):
        lengths = [9, 300, 41, 77, 5, 130][: max(3, len(params))]
        for i, n in enumerate(lengths):
            llm._add([(7 * i + j) % 997 for j in range(n)], params[i % len(params)], False)
        prefill = llm.scheduler.schedule()
        assert prefill.is_prefill
        if not graphs:
            llm.runner.graphs = None
        launch_two_steps_without_host_sync(llm, prefill)  # then decode, a token in flight
        llm.abort(prefill.seqs)


def test_graphs_and_eager_generate_the_same_tokens(gpu_model, backend):
    prompts = [[(3 * i + j) % 991 for j in range(10 + 50 * i)] for i in range(5)]
    # Greedy and the mixed options (the unseeded rows differ by their drawn seeds, so only
    # greedy and seeded rows are compared).
    for params in ([SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)], MIXED):
        params = [params[i % len(params)] for i in range(len(prompts))]
        with_graphs = _engine(gpu_model, backend).generate(prompts, params)
        eager = _engine(gpu_model, backend, enforce_eager=True).generate(prompts, params)
        for p, a, b in zip(params, with_graphs, eager):
            if p.greedy or p.seed is not None:
                assert a.token_ids == b.token_ids, p


def test_captures_pause_the_garbage_collector():
    """A collection inside a capture may free a dead engine's CUDA graphs (one kept in a
    reference cycle), which ends the capture ("operation failed due to a previous error
    during capture"): every capture runs with the cyclic collector paused, and gets it back
    after, also when the code it captures raises."""
    import gc

    from nanoqwen.runtime.graph_capture import capture

    x = torch.ones(4, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with capture(graph):
        assert not gc.isenabled()
        y = x * 2
    assert gc.isenabled()
    graph.replay()
    assert y.tolist() == [2.0] * 4
    with pytest.raises(ValueError), capture(torch.cuda.CUDAGraph()):
        y = x * 3
        raise ValueError("an error while capturing")
    assert gc.isenabled()


@pytest.mark.parametrize("block_size", [16, 64])
def test_auto_runs_triton_with_graphs_without_flash_attn(gpu_model, block_size, monkeypatch):
    """A GPU without flash-attn still gets the Triton backend and its CUDA graphs at any
    block size (the tests above check what they compute)."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    llm = LLM(
        str(gpu_model),
        device="cuda",
        dtype="bfloat16",
        block_size=block_size,
        num_kv_blocks=4096 // block_size,
        max_num_seqs=8,
        progress=False,
    )
    assert llm.runner.model.layers[0].self_attn.backend.name == "triton"
    assert llm.runner.model.layers[0].self_attn.backend.flash is None
    assert llm.runner.graphs is not None
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3]], params)[0].token_ids) == 16


def test_cascade_decode_matches_plain_decode(gpu_model):
    """40 sequences after one 600-token prefix (two shared blocks): the step takes the
    cascade graph, which replays as its eager run and picks the plain decode's tokens."""
    pytest.importorskip("flash_attn")
    llm = _engine(gpu_model, ("triton", 256, True), max_model_len=1024)
    graphs = llm.runner.graphs
    assert graphs.cascade_from == 32
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prefix = [(5 * j) % 997 for j in range(600)]
    llm._add(prefix + [1], params, detokenize=False)
    llm.step()  # the prefix's blocks are cached from here on
    for i in range(39):
        llm._add(prefix + [(11 * i + j) % 997 for j in range(3 + i)], params, detokenize=False)
    while llm.scheduler.waiting:
        llm.step()
    b = llm.scheduler.schedule()
    assert not b.is_prefill and len(b.seqs) == 40
    assert {s.block_table[0] for s in b.seqs} == {b.seqs[0].block_table[0]}
    key = graphs.key_for(40, max(len(s) for s in b.seqs), llm.runner.sampler.filtering, True)
    graph_logits = llm.runner.compute_logits(b).clone()
    assert graphs.meta[key].prefix_len is not None
    assert int(graphs.meta[key].prefix_len[0]) == 512
    bs = key[0]
    model = llm.runner.model
    with torch.inference_mode():
        eager = model.compute_logits(model(graphs.ids[:bs], graphs.meta[key]))[:40]
    assert torch.equal(graph_logits, eager)
    llm.runner.graphs = None
    plain = llm.runner.compute_logits(b)
    # The plain step runs the Triton decode kernel, the cascade step flash-attn (both parts):
    # other roundings. The H200 measured such cross-kernel differences on tiny models up to
    # 0.5 logits (tests/gpu/test_speculative_and_mixed_gpu.py); a wrong prefix falls several
    # logits below (tests/gpu/test_cascade_gpu.py holds both kernels to a float32 reference).
    chosen = plain.gather(1, graph_logits.argmax(-1, keepdim=True)).squeeze(1)
    short = plain.max(-1).values - chosen
    assert float(short.max()) <= 1.0, short


def test_capture_warm_ups_run_every_padding_row(gpu_model):
    """Before each capture a batch of padding rows runs once. The decode kernel runs rows
    in the graph's launch order, so the order must name every row: an order of zeros left
    the other rows' attention output as whatever memory held, and NaN there made the sampler
    count tokens past the vocabulary, into memory after its tables (the graphs' own inputs,
    once: the next engine's embedding then failed on an id past the vocabulary)."""
    # What the caching allocator hands out next holds NaN, as memory a finished engine freed.
    torch.empty(2**28, device="cuda").fill_(float("nan"))
    llm = LLM(str(gpu_model), device="cuda", dtype="bfloat16", attention_backend="triton",
              block_size=16, num_kv_blocks=1024, max_num_seqs=40, progress=False)  # fmt: skip
    graphs, state = llm.runner.graphs, llm.runner.sampler.state
    for (bs, *_), meta in graphs.meta.items():
        assert sorted(meta.decode_order.tolist()) == list(range(bs))
    # Every warm-up row sampled in the scratch slot, each token inside its row of counts
    # (each prefill graph's warm-up samples each of its logit rows there too).
    warm_ups = sum(bs for bs, *_ in graphs.meta)
    warm_ups += sum(rows for _, rows, _ in llm.runner.prefill_graphs.graphs)
    assert int(state.counts[state.scratch].sum()) == warm_ups
    assert int(graphs.ids.abs().sum()) == 0


def _prefill_engine(gpu_model, backend, **kw) -> LLM:
    """An engine with prefill graphs, where its backend captures them (flash_backend.py
    says why flash-attn's may not)."""
    llm = _engine(gpu_model, backend, **kw)
    if not llm.runner.model.layers[0].self_attn.backend.captures_prefill:
        assert llm.runner.prefill_graphs is None
        pytest.skip(f"the {backend[0]} backend captures no prefill")
    assert llm.runner.prefill_graphs.sizes == buckets(kw.get("max_num_batched_tokens", 8192))
    return llm


def _prefill_one(llm: LLM, prompt: list[int], params=None) -> Batch:
    llm._add(prompt, params or SamplingParams(temperature=0.0, max_tokens=8), detokenize=False)
    b = llm.scheduler.schedule()
    assert b.is_prefill and len(b.seqs) == 1
    return b


def _forward_eagerly(graphs, key) -> torch.Tensor:
    """The logits the prefill graph of key computes, run eagerly over its buffers as they
    are (without its sampler, which would count the rows as outputs again)."""
    sampler, graphs.sampler = graphs.sampler, None
    try:
        with torch.inference_mode():
            return graphs.forward(key)[0]
    finally:
        graphs.sampler = sampler


def _eager_step_logits(runner, b: Batch, monkeypatch) -> torch.Tensor:
    """The runner's eager step of b, its prefill on the Triton kernel as in the graphs."""
    monkeypatch.setattr(triton_backend, "PREFILL_WITH_FLASH_ATTN", False)
    graphs, runner.prefill_graphs = runner.prefill_graphs, None
    try:
        return runner.compute_logits(b)
    finally:
        runner.prefill_graphs = graphs


def _check_prefill_graph(llm: LLM, b: Batch, bucket: int, monkeypatch) -> None:
    """The graph's logits are its step's run eagerly on its own buffers, bit for bit, and
    close to the runner's eager prefill of the chunk alone, on the same attention kernel.
    (flash-attn's prefill, which the eager step takes where installed, differs from the
    Triton kernel by a bf16 step here and there: up to ~0.1 in these logits.)"""
    runner, graphs = llm.runner, llm.runner.prefill_graphs
    assert graphs.bucket(b) == bucket
    graph_logits = runner.compute_logits(b).clone()
    assert torch.equal(graph_logits, _forward_eagerly(graphs, (bucket, 1, False))[:1])
    plain = _eager_step_logits(runner, b, monkeypatch)
    assert plain.shape == graph_logits.shape == (1, 1000)
    # Other GEMM shapes (the bucket's rows), so not bit for bit; a wrong key or row would
    # move these logits (~6 at most) by far more.
    torch.testing.assert_close(graph_logits, plain, rtol=0.02, atol=0.1)
    top2 = plain[0].topk(2).values
    if top2[0] - top2[1] > 0.2:
        assert torch.equal(plain.argmax(-1), graph_logits.argmax(-1))


@pytest.mark.parametrize("length", [1, 15, 16, 17, 100, 512])
def test_prefill_graph_replay_matches_eager(gpu_model, backend, length, monkeypatch):
    llm = _prefill_engine(gpu_model, backend)
    # The capture warm-ups wrote nothing outside the KV cache's scratch block.
    kv = llm.runner.kv
    assert not any(t[: kv.scratch_block].any() for t in kv.k + kv.v)
    assert all(torch.isfinite(t).all() for t in llm.runner.model.state_dict().values())
    b = _prefill_one(llm, [(7 * j) % 997 for j in range(length)])
    bucket = next(s for s in (16, 32, 64, 128, 256, 512) if s >= length)
    _check_prefill_graph(llm, b, bucket, monkeypatch)


def test_prefill_graph_after_a_cached_prefix(gpu_model, backend, monkeypatch):
    """A prompt whose first 512 tokens are cached runs only its last 20 in the graph."""
    llm = _prefill_engine(gpu_model, backend)
    prefix = [(5 * j) % 997 for j in range(512)]
    # Finished first: a running request's next token would share the step (a mixed step).
    llm.generate([prefix + [1, 2]], SamplingParams(temperature=0.0, max_tokens=1))
    b = _prefill_one(llm, prefix + [(3 * j) % 997 for j in range(20)])
    assert b.seqs[0].num_computed_tokens == 512 and b.num_new_tokens == [20]
    _check_prefill_graph(llm, b, 32, monkeypatch)


@pytest.mark.parametrize("params", MIXED, ids=map(str, range(6)))
def test_prefill_graph_steps_have_no_host_sync(gpu_model, backend, params):
    llm = _prefill_engine(gpu_model, backend)
    b = _prefill_one(llm, [(7 * j) % 997 for j in range(40)], params)
    assert llm.runner.prefill_graphs.can_run(b)
    launch_two_steps_without_host_sync(llm, b)


def test_prefill_graphs_and_eager_generate_the_same_tokens(gpu_model, backend, monkeypatch):
    """One request at a time, so each prefill is a single prompt (the graphs' case); the
    triton backend's engines both prefill with its own kernel (see _check_prefill_graph).
    flash-attn's graphs split the keys where its eager step may not (flash_backend.py), so
    there greedy tokens may part, but only where the eager engine's two best logits tie."""
    monkeypatch.setattr(triton_backend, "PREFILL_WITH_FLASH_ATTN", False)
    with_graphs = _prefill_engine(gpu_model, backend)
    eager = _engine(gpu_model, backend, enforce_eager=True)
    assert eager.runner.prefill_graphs is None
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for length in (3, 40, 300, 600):
        prompt = [(3 * length + j) % 991 for j in range(length)]
        for p in (greedy, MIXED[2]):
            a = with_graphs.generate([prompt], p)[0].token_ids
            b = eager.generate([prompt], p)[0].token_ids
            if backend[0] != "flash-attn" or a == b or p is not greedy:
                assert a == b, (length, p)
                continue
            k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            logits = eager.runner.prompt_logits(prompt + b[:k], last=1)[0]
            best = logits.topk(2)
            assert sorted(best.indices.tolist()) == sorted([a[k], b[k]]), (length, k)
            # Four bf16 steps at the logits' size: the two engines' hidden states differ by
            # bf16 roundings, which 18 tokens of decoding moved by ~2 steps here.
            step = 2.0 ** (torch.floor(torch.log2(best.values[0])).item() - 7)
            assert best.values[0] - best.values[1] <= 4 * step, (length, k, best.values)


def _mixed_batch(llm: LLM, streams: int, chunk_prompt: int, params=None) -> Batch:
    """streams sequences decoding, then a prompt of chunk_prompt tokens: the step that
    follows is mixed (their next tokens beside its first chunk)."""
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    _decode_batch(llm, [20 + 3 * i for i in range(streams)], params or [long])
    while any(s.num_output_tokens < 2 for s in llm.scheduler.running):
        llm.step()
    llm._add([(11 * j) % 997 for j in range(chunk_prompt)], SamplingParams(max_tokens=4),
             detokenize=False)  # fmt: skip
    b = llm.scheduler.schedule()
    assert b.is_prefill and len(b.seqs) > 1 and b.num_new_tokens[:-1] == [1] * (len(b.seqs) - 1)
    return b


@pytest.mark.parametrize("streams", [1, 13, 60])
def test_mixed_step_graph_matches_its_eager_forward(gpu_model, backend, streams, monkeypatch):
    """Streams beside a prompt's chunk in one graph, some ids still in flight: the replay's
    logits are those of the same step run eagerly over the graph's buffers, bit for bit, and
    close to the runner's eager step (other GEMM shapes and, with flash-attn, its prefill)."""
    llm = _prefill_engine(gpu_model, backend, max_num_batched_tokens=128)
    b = _mixed_batch(llm, streams, 300)
    runner, graphs = llm.runner, llm.runner.prefill_graphs
    assert graphs.bucket(b) == 128 and len(b.seqs) == streams + 1
    replays = []
    graphs.replay = lambda key, f=graphs.replay: replays.append(key) or f(key)
    graph_logits = runner.compute_logits(b).clone()
    # one stream takes the graph of one logit row (at one row the lm_head may be another
    # kernel than at many: compare like with like)
    rows = 1 if streams == 1 else graphs.capacity(128) - 1
    assert replays == [(128, rows, False)] and graph_logits.shape == (streams, 1000)
    assert torch.equal(graph_logits, _forward_eagerly(graphs, (128, rows, False))[:streams])
    plain = _eager_step_logits(runner, b, monkeypatch)
    torch.testing.assert_close(graph_logits, plain, rtol=0.02, atol=0.1)


def test_streams_beside_a_long_prompt_in_graphs_keep_their_tokens(gpu_model, backend, monkeypatch):
    """Greedy and seeded streams decode while a long prompt prefills in chunks of a 64-token
    budget: every mixed step replays a graph, and every request's tokens are those of an
    eager engine (both prefill with the Triton kernel)."""
    if backend[0] == "flash-attn":
        pytest.skip("flash-attn's graphs may split keys where its eager step does not")
    monkeypatch.setattr(triton_backend, "PREFILL_WITH_FLASH_ATTN", False)
    params = [MIXED[0], MIXED[2], MIXED[5]]
    runs = []
    for eager in (False, True):
        llm = _engine(gpu_model, backend, max_num_batched_tokens=64, enforce_eager=eager)
        replays = []
        if not eager:
            graphs = llm.runner.prefill_graphs
            graphs.replay = lambda key, f=graphs.replay, seen=replays: seen.append(key) or f(key)
        seqs = [llm.add_request([(5 * i + j) % 997 for j in range(9 + i)], p)
                for i, p in enumerate(params)]  # fmt: skip
        for _ in range(3):
            llm.step()
        long = llm.add_request([(13 * j) % 997 for j in range(400)], MIXED[0])
        seqs.append(long)
        while llm.scheduler.has_unfinished():
            llm.step()
        llm.drain()
        runs.append([s.output_token_ids for s in seqs])
        if not eager:
            assert sum(key[:2] == (64, 64) for key in replays) >= 5  # the mixed steps
    assert runs[0] == runs[1]


@pytest.mark.parametrize("params", MIXED, ids=map(str, range(6)))
def test_mixed_step_graphs_have_no_host_sync(gpu_model, backend, params):
    llm = _prefill_engine(gpu_model, backend, max_num_batched_tokens=128)
    b = _mixed_batch(llm, 5, 200, [params])
    assert llm.runner.prefill_graphs.can_run(b)
    launch_two_steps_without_host_sync(llm, b)
