"""kernels/triton/select.py, the sampler's candidate selection: store_above's values above a
floor (at most K); ties, -0.0, -inf padding and K equal to the block included. In Triton's
CPU interpreter without a GPU, compiled for it with one."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from nanoqwen.kernels.triton.select import store_above  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _above_kernel(x_ptr, n, out_ptr, floor_ptr, BLOCK: tl.constexpr, K: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=float("-inf"))
    tl.store(floor_ptr, store_above(x, tl.max(x, axis=0), out_ptr, K))


def run(kernel, x: torch.Tensor, k: int) -> tuple[torch.Tensor, float]:
    out = torch.full((k,), float("nan"), device=DEVICE)
    scalar = torch.empty(1, device=DEVICE)
    block = triton.next_power_of_2(max(x.numel(), k))
    kernel[(1,)](x.to(DEVICE), x.numel(), out, scalar, BLOCK=block, K=k)
    return out.cpu(), float(scalar)


CASES = {
    "distinct": torch.randn(2048, generator=torch.Generator().manual_seed(0)),
    "ties at the k-th": torch.randint(-6, 6, (2048,), generator=torch.Generator().manual_seed(1))
    .float()
    .div(2),
    "all equal": torch.full((300,), 1.5),
    "signed zeros": torch.tensor([0.0, -0.0, -1.0, 2.0, -0.0, 0.0, -3.0, 0.5] * 8),
    "fewer finite than k": torch.tensor([3.0, 1.0, float("-inf"), 2.0] + [float("-inf")] * 60),
    "k is the block": torch.randn(64, generator=torch.Generator().manual_seed(2)),
}


@pytest.mark.parametrize("k", [1, 8, 64])
@pytest.mark.parametrize("name", CASES)
def test_every_value_above_the_floor_and_at_most_k(name, k):
    x = CASES[name]
    out, floor = run(_above_kernel, x, k)
    above = x[x > floor]
    assert above.numel() <= k
    assert torch.equal(out[: above.numel()].sort().values, above.sort().values), name
    assert bool((out[above.numel() :] == float("-inf")).all())
    if name == "distinct":  # near the k-th largest: most of the k places used
        assert above.numel() >= k // 2, (above.numel(), k)


@triton.jit
def _above_lowest_kernel(
    x_ptr, n, lowest, out_ptr, floor_ptr, BLOCK: tl.constexpr, K: tl.constexpr
):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=float("-inf"))
    tl.store(floor_ptr, store_above(x, tl.max(x, axis=0), out_ptr, K, lowest))


@pytest.mark.parametrize("lowest", [2.5, 0.0, -1.0])
def test_a_floor_never_below_lowest_and_lowest_itself_where_it_leaves_k(lowest):
    """Standard normal values: 2.5 leaves 17 of the 2,048 above it (at most 64: the floor is
    2.5 and all of them are kept), 0.0 and -1.0 leave more than 64 (the floor is near the
    64th largest, above lowest)."""
    x = CASES["distinct"]
    k = 64
    out = torch.full((k,), float("nan"), device=DEVICE)
    scalar = torch.empty(1, device=DEVICE)
    _above_lowest_kernel[(1,)](x.to(DEVICE), x.numel(), lowest, out, scalar, BLOCK=2048, K=k)
    out, floor = out.cpu(), float(scalar)
    above = x[x > floor]
    assert floor >= lowest and above.numel() <= k
    assert torch.equal(out[: above.numel()].sort().values, above.sort().values)
    if int((x > lowest).sum()) <= k:
        assert floor == lowest
    else:
        assert above.numel() >= k // 2
