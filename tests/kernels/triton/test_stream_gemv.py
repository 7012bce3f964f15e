"""The streamed batch-1 GEMV for large weights (kernels/triton/stream_gemv.py) in Triton's
CPU interpreter, float32, against the layers it replaces: tiles past the weight's columns and
rows, columns split over programs, the bias, SiLU·up and the add+RMSNorm in front."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter"
)
from nanoqwen.kernels.triton import stream_gemv as sg  # noqa: E402
from nanoqwen.kernels.triton.counters import zeroed_counters  # noqa: E402
from nanoqwen.kernels.triton.stream_gemv import StreamGemvConfig, stream_gemv  # noqa: E402

# (rows, columns): partial blocks of rows and tiles of columns, and columns that split unevenly.
SHAPES = [(37, 300), (16, 1024), (50, 708)]
CONFIGS = {
    "one-split": StreamGemvConfig(rows=16, cols=64, splits=1, num_stages=2),
    "3-splits": StreamGemvConfig(rows=16, cols=64, splits=3, num_stages=3),
    "8-rows-2-splits": StreamGemvConfig(rows=8, cols=128, splits=2),
}


@pytest.fixture(params=[0, 2, 3], ids=["in-loop", "2-tiles-ahead", "3-tiles-ahead"])
def ahead(request, monkeypatch):
    """On a GPU that launches it as a programmatic dependent, the first tiles are copied
    before the loop (and the wait), as many as a split holds: the same here, without the
    wait."""
    as_launched = sg.tiles_ahead
    monkeypatch.setattr(
        sg, "tiles_ahead",
        lambda cfg, pdl, chunk: as_launched(replace(cfg, ahead=request.param), True, chunk),
    )  # fmt: skip


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_stream_gemv_equals_linear(n, k, config, ahead):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    y = stream_gemv(x, w, b, config=CONFIGS[config])
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert torch.equal(stream_gemv(x, w, b, config=CONFIGS[config]), y)  # split order
    assert not zeroed_counters(x.device, 1, "stream gemv splits").any()


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_stream_gemv_silu_mul_equals_mlp_activation(n, k, config, ahead):
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=gen)
    gate_up = torch.randn(2 * n, k, generator=gen) * 0.1
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    act = stream_gemv(x, gate_up, silu_mul=True, config=CONFIGS[config])
    torch.testing.assert_close(act, F.silu(gate) * up, rtol=1e-4, atol=1e-3)


# (rows of at least 2,048 are summed in one wide load, shorter ones a chunk at a time)
@pytest.mark.parametrize("k", [708, 2500])
@pytest.mark.parametrize("residual", [False, True], ids=["first-layer", "residual"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_stream_norm_gemv_equals_add_rms_norm_then_the_projection(residual, config, ahead, k):
    """The projection of the normalized row, and x + residual as the residual stream's next
    value, stored once however many programs normalize the row."""
    n = 37
    gen = torch.Generator().manual_seed(k + residual)
    x = torch.randn(1, k, generator=gen)
    res = torch.randn(1, k, generator=gen) if residual else None
    nw = torch.rand(k, generator=gen) + 0.5
    w = torch.randn(2 * n, k, generator=gen)
    b = torch.randn(2 * n, generator=gen)
    total = x + res if residual else x
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    y, new_residual = stream_gemv(x, w, b, norm=(res, nw, 1e-6), config=CONFIGS[config])
    torch.testing.assert_close(y, F.linear(normed, w, b), rtol=1e-4, atol=1e-3)
    assert torch.equal(new_residual, total)
    act, new_residual = stream_gemv(x, w, silu_mul=True, norm=(res, nw, 1e-6),
                                    config=CONFIGS[config])  # fmt: skip
    gate, up = F.linear(normed, w).chunk(2, dim=-1)
    torch.testing.assert_close(act, F.silu(gate) * up, rtol=1e-3, atol=1e-2)
    assert torch.equal(new_residual, total)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_residual_add_after_the_product_and_the_norm_from_its_squares(config, ahead):
    """o_proj, then the add+RMSNorm and gate_up, as one row runs them at 7B: the first launch
    finishes the residual stream (its product plus the residual) with its blocks' sums of
    squares, the next two normalize that stream from those sums."""
    n, k, m = 52, 708, 37  # rows of 52 floats: 16-byte strides for the next weight
    gen = torch.Generator().manual_seed(n + k)
    x, res = torch.randn(1, k, generator=gen), torch.randn(1, n, generator=gen)
    w = torch.randn(n, k, generator=gen)
    stream, squares = stream_gemv(x, w, residual=res, config=CONFIGS[config])
    assert torch.equal(stream, stream_gemv(x, w, config=CONFIGS[config]) + res)
    blocks = -(-n // CONFIGS[config].rows)
    assert squares.shape == (1, blocks) and squares.dtype == torch.float32
    torch.testing.assert_close(squares.sum(), stream.pow(2).sum())
    nw = torch.rand(n, generator=gen) + 0.5
    w2, b2 = torch.randn(2 * m, n, generator=gen), torch.randn(2 * m, generator=gen)
    normed = stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    y, same = stream_gemv(stream, w2, b2, norm=(None, nw, 1e-6), squares=squares)
    torch.testing.assert_close(y, F.linear(normed, w2, b2), rtol=1e-4, atol=1e-3)
    assert same is stream
    act, _ = stream_gemv(stream, w2, silu_mul=True, norm=(None, nw, 1e-6), squares=squares,
                         config=CONFIGS[config])  # fmt: skip
    gate, up = F.linear(normed, w2).chunk(2, dim=-1)
    torch.testing.assert_close(act, F.silu(gate) * up, rtol=1e-3, atol=1e-2)


def test_squares_take_a_norm_over_the_stream_alone():
    x, w = torch.randn(1, 64), torch.randn(16, 64)
    squares = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="squares go with a norm"):
        stream_gemv(x, w, norm=(torch.randn(1, 64), torch.ones(64), 1e-6), squares=squares)
    with pytest.raises(ValueError, match="residual add after the product"):
        stream_gemv(x, w, norm=(None, torch.ones(64), 1e-6), residual=torch.randn(1, 16))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_stream_norm_gemv_reads_the_first_layers_row_from_the_embedding_table(config, ahead):
    """The first layer at one row: the GEMV takes the embedding table and the token id, and
    returns the projection of that row normalized, and the row itself (the residual stream)."""
    vocab, n, k = 11, 37, 708
    gen = torch.Generator().manual_seed(k)
    table = torch.randn(vocab, k, generator=gen)
    nw = torch.rand(k, generator=gen) + 0.5
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    ids = torch.tensor([7])
    row = table[7:8]
    normed = row * torch.rsqrt(row.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    y, residual = stream_gemv(table, w, b, norm=(None, nw, 1e-6), config=CONFIGS[config],
                              ids=ids)  # fmt: skip
    torch.testing.assert_close(y, F.linear(normed, w, b), rtol=1e-4, atol=1e-3)
    assert torch.equal(residual, row)


def test_float32_output_of_a_half_precision_row_with_the_norm_in_front():
    """float32 logits from a float16 row (the lm_head's case): the normalized row rounds to
    float16 as the separate norm's output would, the sums are not rounded."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 256, generator=gen).half()
    res = torch.randn(1, 256, generator=gen).half()
    nw = (torch.rand(256, generator=gen) + 0.5).half()
    w = (torch.randn(40, 256, generator=gen) * 0.1).half()
    total = (x.float() + res.float()).half()
    var = total.float().pow(2).mean(-1, keepdim=True)
    normed = ((total.float() * torch.rsqrt(var + 1e-6)).half().float() * nw.float()).half()
    y, _ = stream_gemv(x, w, norm=(res, nw, 1e-6), config=CONFIGS["3-splits"],
                       out_dtype=torch.float32)  # fmt: skip
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, normed.float() @ w.float().t(), rtol=1e-5, atol=1e-5)
    # Into a row of a larger buffer (the CUDA graphs' shared logits), the rest untouched.
    buf = torch.full((3, 40), 7.0)
    into, _ = stream_gemv(x, w, norm=(res, nw, 1e-6), config=CONFIGS["3-splits"],
                          out_dtype=torch.float32, out=buf[:1])  # fmt: skip
    assert into.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[0], y[0]) and torch.equal(buf[1:], torch.full((2, 40), 7.0))


def test_large_weights_take_the_streamed_kernel(monkeypatch):
    """gemv.py hands weights above GEMV_MAX_BYTES to the streamed kernel, with its flags."""
    from nanoqwen.kernels.triton import gemv

    calls = []

    def stream(*args, ids=None):
        calls.append((*args[3:], ids))
        return args[0]

    monkeypatch.setattr(gemv, "stream_gemv", stream)
    monkeypatch.setattr(gemv, "GEMV_MAX_BYTES", 64 * 4 * 4 - 1)
    x = torch.randn(1, 64)
    gemv.gemv(x, torch.randn(4, 64))  # 1 KiB: streamed
    gemv.gemv(x, torch.randn(3, 64))  # under: the plain GEMV
    gemv.gemv_silu_mul(x, torch.randn(8, 64))
    table, ids, nw = torch.randn(10, 64), torch.tensor([3]), torch.ones(64)
    gemv.embed_norm_gemv(table, ids, nw, 1e-6, torch.randn(4, 64))
    assert calls == [(False, None, None), (True, None, None), (False, (None, nw, 1e-6), ids)]


def test_stream_gemv_config_fills_the_gpu_with_whole_tiles():
    """7B's shapes: short, wide weights split their columns, tall ones do not."""
    cfg = sg.stream_gemv_config
    assert cfg(4608, 3584).splits == 2  # qkv: 288 blocks of 16 rows
    assert cfg(3584, 3584).splits == 3  # o_proj
    assert cfg(3584, 18944).splits == 3  # down_proj
    assert cfg(18944, 3584).splits == 1  # gate_up (gate rows)


def test_a_grid_in_one_wave_lets_the_kernel_behind_launch_at_its_start():
    """7B's launches on 132 SMs: o_proj's 672 programs fit in one wave (three stages of 8 KB
    tiles, eight an SM), gate_up's 1,184 (16 KB of gate and up rows a stage, four an SM) do
    not; StreamGemvConfig.early overrides either."""
    cpu, cfg = torch.device("cpu"), sg.stream_gemv_config
    assert sg.launches_early(cfg(3584, 3584), 672, False, 2, cpu)
    assert not sg.launches_early(cfg(18944, 3584), 1184, True, 2, cpu)
    assert sg.launches_early(replace(cfg(18944, 3584), early=1), 1184, True, 2, cpu)
    assert not sg.launches_early(replace(cfg(3584, 3584), early=0), 672, False, 2, cpu)
