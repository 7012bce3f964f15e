"""What else rides on the low-latency all-reduce's packets, run by Triton's interpreter in 2
and 3 processes as test_custom_all_reduce.py runs the all-reduces: the all-reduce fused with
the residual add and RMSNorm (kernels/triton/all_reduce_norm.py) against HF's numerics in torch and
behind ReducingRMSNorm against the unfused pair, the all-gather of the logits and the
broadcast of a graph's inputs; all interleaved with plain all-reduces, whose programs and
epochs they share."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoqwen.kernels.layer_ops import triton_ops
from nanoqwen.model.tensor_parallel import ReducingRMSNorm, TensorParallel, gather_vocab
from nanoqwen.runtime.parallel.group import spawn_store

from .test_custom_all_reduce import PROGRAMS, interpreted, join

EPS = 1e-6
# (rows, cols, dtype, with a residual): rows padded to a power of two of words, a row per
# program up to all of them, float32 (one value a word) and float16 (two).
CASES = [
    (1, 64, torch.float16, True), (3, 96, torch.float16, True), (1, 64, torch.float16, False),
    (2, 34, torch.float32, True), (PROGRAMS, 200, torch.float16, True),
    (2, 50, torch.float32, False),
]  # fmt: skip


def run_ranks(fn, world: int) -> None:
    """fn(rank, world, port) in a process per rank, the rendezvous held here meanwhile."""
    store = spawn_store(world)
    mp.spawn(fn, args=(world, store.port), nprocs=world)


def hf_reference(xs: list[torch.Tensor], residual, weight: torch.Tensor):
    """The ranks' sum (float32, rank order, rounded once), then HF's add and RMSNorm."""
    dtype = xs[0].dtype
    summed = sum((x.float() for x in xs), torch.zeros(xs[0].shape)).to(dtype)
    stream = summed if residual is None else (summed.float() + residual.float()).to(dtype)
    h = stream.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    return (normed.float() * weight.float()).to(dtype), stream


def assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """The sum of squares adds in another order than torch's mean: the last bit may move
    (of every float32 value, as the scale moves; of few rounded to 16 bits)."""
    info = torch.finfo(want.dtype)
    ulp = 2 * info.eps * want.float().abs().clamp_min(info.tiny)  # an ulp is eps * 2^exponent
    assert bool(((got.float() - want.float()).abs() <= ulp).all()), (got - want).abs().max()
    if want.element_size() == 2:
        assert (got != want).float().mean() < 0.05


def case_inputs(i: int, rows: int, cols: int, dtype: torch.dtype, world: int):
    g = torch.Generator().manual_seed(100 + i)
    xs = [torch.randn(rows, cols, generator=g).to(dtype) for _ in range(world)]
    residual = torch.randn(rows, cols, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(cols, generator=g)).to(dtype)
    return xs, residual, weight


def fused_rank(rank: int, world: int, port: int) -> None:
    reducer = join(rank, world, port, 600)
    results = []
    for i, (rows, cols, dtype, with_residual) in enumerate(CASES):
        xs, residual, weight = case_inputs(i, rows, cols, dtype, world)
        want_out, want_stream = hf_reference(xs, residual if with_residual else None, weight)
        x, res = xs[rank].clone(), residual.clone() if with_residual else None
        assert reducer.takes_rms_norm(x, res)
        out, stream = reducer.all_reduce_rms_norm(x, res, weight, EPS)
        assert stream is (res if with_residual else x)
        assert torch.equal(stream, want_stream), i
        assert_within_one_ulp(out, want_out)
        results += [out, stream]
        plain = xs[rank][0].clone()  # a plain all-reduce between: programs shared, epochs too
        assert reducer(plain)
        assert torch.equal(plain, hf_reference([v[0] for v in xs], None, weight[:1])[1])
    # Rows past the programs, a row of an odd number of 16-bit values, a strided x: refused.
    assert not reducer.takes_rms_norm(torch.ones(PROGRAMS + 1, 8), None)
    assert not reducer.takes_rms_norm(torch.ones(2, 33, dtype=torch.float16), None)
    assert not reducer.takes_rms_norm(torch.ones(8, 4)[:, :2], None)
    assert not reducer.takes_rms_norm(torch.ones(2, 8), torch.ones(2, 8, dtype=torch.float16))
    assert reducer.error() is None
    everyone = [None] * world
    dist.all_gather_object(everyone, (results, reducer.state.tolist()), group=dist.group.WORLD)
    for other, state in everyone:  # bitwise the same everywhere, epochs too
        assert all(torch.equal(a, b) for a, b in zip(other, results))
        assert state == reducer.state.tolist()
    dist.destroy_process_group()


@interpreted
@pytest.mark.parametrize("world", [2, 3])
def test_fused_all_reduce_add_and_norm_match_hf_on_every_rank(world):
    run_ranks(fused_rank, world)


def norm_rank(rank: int, world: int, port: int) -> None:
    reducer = join(rank, world, port, 600)
    tp, tp_nccl = TensorParallel(rank, world, None, reducer), TensorParallel(rank, world)
    fused = ReducingRMSNorm(96, EPS, torch.float16, "cpu", tp)
    unfused = ReducingRMSNorm(96, EPS, torch.float16, "cpu", tp_nccl)
    fused.ops = unfused.ops = triton_ops()  # the Triton add + norm, as on a GPU
    xs, residual, weight = case_inputs(0, 2, 96, torch.float16, world)
    fused.weight.copy_(weight)
    unfused.weight.copy_(weight)
    for res in (None, residual):
        x = xs[rank].clone()
        got, got_stream = fused(x, None if res is None else res.clone())
        want, want_stream = unfused(xs[rank].clone(), None if res is None else res.clone())
        assert torch.equal(got_stream, want_stream)
        assert_within_one_ulp(got, want)
    # A view of the model's output is summed in a copy: the output itself stays partial.
    hidden = xs[rank].clone()
    fused(hidden[:1])
    assert torch.equal(hidden, xs[rank])
    assert reducer.ll_state[0].item() == 3  # all three fused, program 0 each time
    dist.destroy_process_group()


@interpreted
def test_reducing_norm_fuses_where_the_custom_all_reduce_can_and_equals_the_unfused_pair():
    run_ranks(norm_rank, 2)


def gather_rank(rank: int, world: int, port: int) -> None:
    reducer = join(rank, world, port, 600)
    tp, tp_gloo = TensorParallel(rank, world, None, reducer), TensorParallel(rank, world)
    # Sizes around the 512-word blocks, several programs, float32 and float16 (2 a word).
    for i, (rows, shard, dtype) in enumerate(
        [(1, 7, torch.float32), (2, 600, torch.float16), (3, 1500, torch.float32)]
    ):
        local = torch.randn(rows, shard, generator=torch.Generator().manual_seed(rank + 10 * i))
        local = local.to(dtype)
        vocab = world * shard - 1  # the last rank's last row is padding, cut
        got = gather_vocab(local, vocab, tp)
        assert torch.equal(got, gather_vocab(local, vocab, tp_gloo))
        assert got.shape == (rows, vocab)
        plain = torch.full((5,), float(rank))
        assert reducer(plain) and torch.equal(plain, torch.full((5,), sum(range(world)) * 1.0))
    # A broadcast in place: rank 0's int64 words everywhere (a graph's inputs, 0.5-2 blocks).
    for n in (3, 700):
        mine = torch.arange(n, dtype=torch.int64) * (rank + 1) - 5
        tp.broadcast(mine)
        assert torch.equal(mine, torch.arange(n, dtype=torch.int64) - 5)
    taken = reducer.ll_state[0].item()
    # Refused: an odd number of 16-bit values, past the buffers; NCCL's (gloo's) then.
    out = torch.empty(world, 3, dtype=torch.float16)
    assert not reducer.all_gather(torch.ones(3, dtype=torch.float16), out)
    big = torch.ones(PROGRAMS * reducer.ll_region + 1)
    assert not reducer.all_gather(big, torch.empty(world * big.numel()))
    assert not reducer.broadcast(big)
    assert reducer.ll_state[0].item() == taken == 8 and reducer.error() is None
    dist.destroy_process_group()


@interpreted
@pytest.mark.parametrize("world", [2, 3])
def test_gather_and_broadcast_through_the_low_latency_kernel_equal_the_group_collectives(world):
    run_ranks(gather_rank, world)
