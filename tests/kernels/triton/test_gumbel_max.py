"""kernels/triton/draw.py gumbel_max, the draws' Gumbel-max over a tile from an estimate of the
noise: the same (score, index) as the exact noise's max, near-ties (where it falls back to
every lane's exact score), masked lanes, -inf and NaN logits included. Compiled for a GPU
the estimate takes fast logs and differs from the exact noise, so the near-ties go through
the fallback; in Triton's CPU interpreter (no fast logs) this checks the plumbing alone."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from nanoqwen.kernels.triton.draw import gumbel, gumbel_max  # noqa: E402
from nanoqwen.runtime.sampling.noise import gumbel as torch_gumbel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 256


@triton.jit
def _draw_kernel(x_ptr, keep_ptr, key_ptr, first, out_ptr, BLOCK: tl.constexpr):
    seed, pos = tl.load(key_ptr), tl.load(key_ptr + 1)  # int64, as the sampler's tables
    lanes = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + lanes)
    keep = tl.load(keep_ptr + lanes) != 0
    offs = first + lanes
    best, lane = gumbel_max(x, keep, seed, pos, offs)
    exact = tl.where(keep & (x > float("-inf")), x + gumbel(seed, pos, offs), float("-inf"))
    tl.store(out_ptr, best)
    tl.store(out_ptr + 1, lane.to(tl.float32))
    tl.store(out_ptr + 2, tl.max(exact, axis=0))
    tl.store(out_ptr + 3, tl.argmax(exact, axis=0).to(tl.float32))


def draw(x: torch.Tensor, keep: torch.Tensor, seed: int, pos: int, first: int) -> list[float]:
    out = torch.empty(4, device=DEVICE)
    key = torch.tensor([seed, pos], dtype=torch.int64, device=DEVICE)
    _draw_kernel[(1,)](x.to(DEVICE), keep.to(DEVICE, torch.int8), key, first, out,
                       BLOCK=BLOCK)  # fmt: skip
    return out.tolist()


def noise(seed: int, pos: int, first: int) -> torch.Tensor:
    """The tile's exact noise, from the torch implementation (bit for bit the kernels')."""
    row = torch_gumbel(torch.tensor([seed]), torch.tensor([pos]), first + BLOCK)[0]
    return row[first:]


@pytest.mark.parametrize("spread", [0.5, 3.0, 40.0])
def test_the_estimate_draws_the_exact_noise_maximum(spread):
    g = torch.Generator().manual_seed(int(spread * 10))
    for trial in range(6):
        x = torch.randn(BLOCK, generator=g) * spread
        keep = torch.rand(BLOCK, generator=g) < (1.0 if trial % 2 else 0.3)
        best, lane, exact_best, exact_lane = draw(x, keep, 1234 + trial, trial, 512 * trial)
        assert (best, lane) == (exact_best, exact_lane)


def test_a_near_tie_falls_back_to_every_lanes_exact_score():
    """Two lanes whose exact scores lie within the estimate's bound of each other: the lane
    the exact noise picks, whichever the estimate put first."""
    seed, pos, first = 99, 3, 1024
    g = noise(seed, pos, first)
    for a, b, gap in ((10, 200, 0.0), (200, 10, 0.0), (10, 200, 2e-4), (10, 200, -2e-4)):
        x = torch.full((BLOCK,), -30.0)
        x[a] = 5.0 - g[a]
        x[b] = 5.0 - g[b] + gap
        best, lane, exact_best, exact_lane = draw(x, torch.ones(BLOCK, dtype=torch.bool), seed,
                                                  pos, first)  # fmt: skip
        assert (best, lane) == (exact_best, exact_lane)
        assert lane in (a, b)


def test_masked_minus_inf_and_nan_lanes_are_never_drawn():
    x = torch.randn(BLOCK, generator=torch.Generator().manual_seed(5))
    x[::3] = float("nan")
    x[1::3] = float("-inf")
    keep = torch.ones(BLOCK, dtype=torch.bool)
    keep[2::6] = False
    best, lane, exact_best, exact_lane = draw(x, keep, 7, 0, 0)
    assert (best, lane) == (exact_best, exact_lane)
    assert int(lane) % 6 == 5
    nothing = draw(torch.full((BLOCK,), float("-inf")), keep, 7, 0, 0)
    assert nothing[0] == float("-inf") and nothing[1] == nothing[3]
