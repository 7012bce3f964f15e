"""The custom one-shot all-reduce on two GPUs: the float32 sum in rank order rounded once,
within a rounding of NCCL's, bitwise the same on every rank; sizes from 1 element to the
limit; a thousand calls queued back to back; inside a CUDA graph replayed many times; a rank
that never comes turns into an error, not a hang; the tp=2 engine's greedy tokens as NCCL's.

Every wait gives up after NANOQWEN_ALL_REDUCE_TIMEOUT_S (20 s here), so a protocol bug fails
these tests instead of hanging the GPUs.
"""

from __future__ import annotations

import faulthandler
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoqwen.model.tensor_parallel import TensorParallel
from nanoqwen.runtime.parallel.custom_all_reduce import (
    SWITCH_ENV,
    TIMEOUT_ENV,
    CustomAllReduce,
    create,
    max_bytes_for,
    release_all,
)
from nanoqwen.runtime.parallel.group import keep_multicast_off, spawn_store

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
WORLD = 2
MAX_BYTES = max_bytes_for(WORLD)
LIMIT = MAX_BYTES // 2  # bfloat16 elements
SIZES = [
    1, 2, 3, 7, 8, 127, 1000, 1023, 1024, 1025, 3584, 4095, 7 * 3584 + 1, 65537, 57 * 3584,
    LIMIT - 1, LIMIT,
]  # fmt: skip
# One rounding apart at most (NCCL may round the float32 sum otherwise): one ulp.
RTOL = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-22}


def spawn(fn, *args) -> None:
    store = spawn_store(WORLD)  # the ranks' rendezvous, held here while they run
    mp.spawn(fn, args=(store.port, *args), nprocs=WORLD)


def join(rank: int, port: int) -> tuple[torch.device, CustomAllReduce]:
    # A rank stuck anywhere (a kernel, a barrier mismatch, an NCCL call its failed peer never
    # makes) prints every thread's stack and exits, so mp.spawn reports it instead of hanging.
    faulthandler.dump_traceback_later(120, exit=True)
    os.environ[TIMEOUT_ENV] = "20"
    os.environ[SWITCH_ENV] = "1"
    keep_multicast_off()
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl", store=spawn_store(WORLD, port), rank=rank, world_size=WORLD,
        device_id=dev, timeout=timedelta(seconds=60),
    )  # fmt: skip
    custom = create(rank, WORLD, dev, dist.new_group(backend="gloo"))
    assert custom is not None, "the custom all-reduce was refused on this machine"
    return dev, custom


def leave(custom: CustomAllReduce) -> None:
    torch.cuda.synchronize()
    assert custom.error() is None, custom.error()
    release_all()  # no rank exits while another maps its buffers
    dist.barrier()
    dist.destroy_process_group()


def every_rank(x: torch.Tensor) -> torch.Tensor:
    """[WORLD, *x.shape]: each rank's x (over NCCL)."""
    out = x.new_empty(WORLD * x.numel())
    dist.all_gather_into_tensor(out, x.contiguous().view(-1))
    return out.view(WORLD, *x.shape)


def check(inp: torch.Tensor, got: torch.Tensor) -> None:
    """got (the custom sum of every rank's inp) is the float32 sum in rank order rounded
    once, close to NCCL's, and the same bits on every rank."""
    want = every_rank(inp).float().sum(0).to(inp.dtype)  # two terms: order-free
    assert torch.equal(got, want), (inp.numel(), (got.float() - want.float()).abs().max())
    nccl = inp.clone()
    dist.all_reduce(nccl)
    torch.testing.assert_close(got, nccl, rtol=RTOL[inp.dtype], atol=1e-30)
    bits = every_rank(got.view(torch.uint8))  # bytes: NCCL has no int16
    assert torch.equal(bits[0], bits[1])


def sizes_rank(rank: int, port: int) -> None:
    dev, custom = join(rank, port)
    gen = torch.Generator(dev).manual_seed(rank)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n in SIZES:
            if n * torch.finfo(dtype).bits // 8 > MAX_BYTES:
                assert not custom.fits(torch.empty(n, dtype=dtype, device=dev))
                continue
            inp = torch.randn(n, generator=gen, device=dev).to(dtype)
            got = inp.clone()
            assert custom(got)
            check(inp, got)
    leave(custom)


def test_sums_from_one_element_to_the_limit():
    spawn(sizes_rank)


def queued_rank(rank: int, port: int) -> None:
    """50 calls queued without a sync between them (a rank may run ahead of the other), 20
    times over: 1,000 epochs, each program's parity flipping at its own pace."""
    dev, custom = join(rank, port)
    gen = torch.Generator(dev).manual_seed(10 + rank)
    for batch in range(20):
        sizes = [SIZES[(batch * 7 + i * 3) % len(SIZES)] for i in range(50)]
        inputs = [torch.randn(n, generator=gen, device=dev).bfloat16() for n in sizes]
        outputs = [x.clone() for x in inputs]
        for out in outputs:
            assert custom(out)
        for inp, out in zip(inputs, outputs):
            check(inp, out)
    assert int(custom.state[0]) == 1000
    leave(custom)


def test_a_thousand_calls_queued_back_to_back():
    spawn(queued_rank)


def graph_rank(rank: int, port: int) -> None:
    """TensorParallel.all_reduce in a graph: three messages the custom kernel takes and one
    over its limit (NCCL), replayed 300 times over new inputs."""
    dev, custom = join(rank, port)
    tp = TensorParallel(rank, WORLD, None, custom)
    gen = torch.Generator(dev).manual_seed(20 + rank)
    sizes = [1, 3584, 7 * 1025, LIMIT + 8]
    inputs = [torch.zeros(n, dtype=torch.bfloat16, device=dev) for n in sizes]
    outputs = [torch.empty_like(x) for x in inputs]

    def step():
        for inp, out in zip(inputs, outputs):
            out.copy_(inp)
            tp.all_reduce(out)

    step()  # compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # NCCL's watchdog
        step()
    for _ in range(300):
        for x in inputs:
            x.copy_(torch.randn(x.numel(), generator=gen, device=dev))
        graph.replay()
        torch.cuda.synchronize()
        # Before any NCCL check: a kernel that gave up says so here, on both ranks alike,
        # instead of failing one rank's assertion while the other waits in NCCL.
        assert custom.error() is None, custom.error()
        for inp, out in zip(inputs[:3], outputs[:3]):
            check(inp, out)
        nccl = inputs[3].clone()
        dist.all_reduce(nccl)
        torch.testing.assert_close(outputs[3], nccl, rtol=RTOL[torch.bfloat16], atol=1e-30)
    graph.reset()  # NCCL cannot destroy a communicator that a live graph captured
    leave(custom)


def test_replayed_inside_a_cuda_graph():
    spawn(graph_rank)


def stalled_rank(rank: int, port: int, abort: bool) -> None:
    """Rank 1 skips a call: rank 0's kernel gives up (after 2 s, or at once when aborted)
    and says so; rank 1 keeps its buffers mapped until then."""
    dev, custom = join(rank, port)
    x = torch.ones(4096, dtype=torch.bfloat16, device=dev)
    assert custom(x) and bool((x == 2).all())
    custom.timeout = 2 * 10**9  # ns
    if rank == 0:
        if abort:
            custom.abort()
        custom(x)
        torch.cuda.synchronize()
        expected = "was aborted" if abort else "waited longer than"
        assert custom.error() is not None and expected in custom.error(), custom.error()
    dist.barrier(group=dist.new_group(backend="gloo"))
    dist.destroy_process_group()


@pytest.mark.parametrize("abort", [False, True], ids=["timeout", "abort"])
def test_a_rank_that_never_comes_is_an_error_not_a_hang(abort):
    spawn(stalled_rank, abort)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from conftest import write_tiny_model

    path = tmp_path_factory.mktemp("gpu-custom-all-reduce")
    write_tiny_model(
        path, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=512, num_hidden_layers=3, vocab_size=1001,
    )  # fmt: skip
    return path


def test_tp2_greedy_tokens_are_nccls(model_dir, monkeypatch):
    """Two ranks: the custom sum and NCCL's are the same rounding of the same float32 sum,
    so prefill logits and greedy tokens (graphs and eager) do not change."""
    from nanoqwen import LLM, SamplingParams

    monkeypatch.setenv(TIMEOUT_ENV, "20")
    prompts = [[(7 * i + 3 * j) % 997 for j in range(20 + 45 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    opts = dict(device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=512)
    opts |= dict(max_num_seqs=32, swap_space=0.5, progress=False, tensor_parallel_size=2)
    runs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(SWITCH_ENV, switch)
        with LLM(str(model_dir), **opts) as llm:
            custom = llm.runner.model.tp.custom_all_reduce
            assert (custom is not None) == (switch == "1")
            tokens = [o.token_ids for o in llm.generate(prompts, params)]
            graphs, llm.runner.graphs = llm.runner.graphs, None
            eager = [o.token_ids for o in llm.generate(prompts, params)]
            llm.runner.graphs = graphs
            logits = [llm.runner.prompt_logits(p) for p in prompts]
            assert custom is None or custom.error() is None
        runs[switch] = tokens, eager, logits
    (tokens, eager, logits), (nccl_tokens, nccl_eager, nccl_logits) = runs["1"], runs["0"]
    assert tokens == eager == nccl_tokens == nccl_eager
    for a, b in zip(logits, nccl_logits):  # equal unless NCCL rounds a sum otherwise
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0)
