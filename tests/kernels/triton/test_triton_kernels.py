"""The Triton GEMV, add+RMSNorm and SiLU·up kernels against the layers they replace.

On CPU these run in Triton's interpreter (tests/conftest.py) in float32; tests/gpu runs the
whole model compiled in bfloat16 against HF.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
# With a GPU the kernels compile for it and cannot take these CPU tensors; tests/gpu covers
# them there (backend agreement, graph replay, fidelity with HF).
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter"
)
from nanoqwen.kernels.layer_ops import TORCH_OPS, triton_ops  # noqa: E402
from nanoqwen.kernels.triton import gemv as gemv_module  # noqa: E402
from nanoqwen.kernels.triton.gemv import gemv, gemv_silu_mul  # noqa: E402

# (rows, columns): down_proj-like long rows, many short rows, and odd sizes that leave
# partial blocks in both directions.
SHAPES = [(37, 300), (5, 2000), (9000, 100), (130, 1100)]


@pytest.fixture(params=[False, True], ids=["blocks", "wide-first-block"])
def first_block(request, monkeypatch):
    """With a GPU that launches the GEMVs as programmatic dependents, their first block is
    wider than the rest (it loads before the wait): the same sizes here, without the wait."""
    if request.param:
        sized = gemv_module._first_block
        monkeypatch.setattr(gemv_module, "_first_block", lambda k, r, c, pdl: sized(k, r, c, True))


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_gemv_equals_linear(n, k, bias, first_block):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    torch.testing.assert_close(gemv(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_gemv_silu_mul_equals_mlp_activation(n, k, first_block):
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=gen)
    gate_up = torch.randn(2 * n, k, generator=gen)
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    torch.testing.assert_close(gemv_silu_mul(x, gate_up), F.silu(gate) * up, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("residual", [False, True], ids=["first-layer", "residual"])
def test_norm_gemv_equals_add_rms_norm_then_the_projection(n, k, residual, first_block):
    """The add+RMSNorm in the GEMV's prologue: the projection of the normalized row, and
    x + residual as the residual stream's next value (x itself in the first layer)."""
    gen = torch.Generator().manual_seed(3 * n + k)
    x = torch.randn(1, k, generator=gen)
    res = torch.randn(1, k, generator=gen) if residual else None
    nw = torch.rand(k, generator=gen) + 0.5
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    total = x + res if residual else x
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    y, new_residual = triton_ops().norm_gemv(x, res, nw, 1e-6, w, b)
    torch.testing.assert_close(y, F.linear(normed, w, b), rtol=1e-4, atol=1e-3)
    assert torch.equal(new_residual, total)
    gate_up = torch.randn(2 * n, k, generator=gen)
    act, new_residual = triton_ops().norm_gemv_silu_mul(x, res, nw, 1e-6, gate_up)
    gate, up = F.linear(normed, gate_up).chunk(2, dim=-1)
    torch.testing.assert_close(act, F.silu(gate) * up, rtol=1e-3, atol=1e-2)
    assert torch.equal(new_residual, total)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_embed_norm_gemv_reads_the_first_layers_row_from_the_embedding_table(n, k, first_block):
    """The first layer at one row: no gather in front; the GEMV reads the token's row of the
    table, and returns its projection normalized and the row itself (the residual stream)."""
    gen = torch.Generator().manual_seed(5 * n + k)
    table = torch.randn(13, k, generator=gen)
    nw = torch.rand(k, generator=gen) + 0.5
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    row = table[12:13]
    normed = row * torch.rsqrt(row.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    y, residual = triton_ops().embed_norm_gemv(table, torch.tensor([12]), nw, 1e-6, w, b)
    torch.testing.assert_close(y, F.linear(normed, w, b), rtol=1e-4, atol=1e-3)
    assert torch.equal(residual, row)


def test_register_cap_keeps_a_short_launch_in_one_wave():
    """0.5B's gate_up at one row (1,216 programs of two warps on 132 SMs): ten programs an SM
    fit at 96 registers a thread; launches that fit anyway, or never could, take no cap."""
    assert gemv_module.register_cap(1216, 2, 132) == 96
    assert gemv_module.register_cap(448, 4, 132) == 128  # 0.5B's down_proj: 4 an SM
    assert gemv_module.register_cap(132, 4, 132) is None  # one an SM: any count fits
    assert gemv_module.register_cap(4864, 4, 132) is None  # 37 an SM: beyond 2,048 threads


@pytest.mark.parametrize("streamed", [False, True], ids=["gemv", "all-streamed"])
def test_fused_model_generates_what_the_reference_layers_generate(
    tiny_model, streamed, monkeypatch
):
    """Batch-1 decode through every fused kernel (add+RMSNorm inside the qkv and gate_up
    GEMVs, GEMV with bias, GEMV with SiLU·up, the final norm inside the lm_head's streamed
    GEMV) picks the same greedy tokens with the same logits; all-streamed: every projection
    on stream_gemv.py's kernel, as 7B's are (weights above GEMV_MAX_BYTES), o_proj and
    down_proj adding the residual in their epilogue and the norms after them taking their
    sums of squares (model/summed_row.py)."""
    from nanoqwen import LLM, SamplingParams

    streamed_calls = set()
    if streamed:
        inner_stream = gemv_module.stream_gemv

        def stream(x, weight, bias=None, silu_mul=False, norm=None, ids=None, squares=None,
                   residual=None):  # fmt: skip
            streamed_calls.add((bias is not None, silu_mul, norm is not None, ids is not None,
                                squares is not None, residual is not None))  # fmt: skip
            return inner_stream(x, weight, bias, silu_mul, norm, ids=ids, squares=squares,
                                residual=residual)  # fmt: skip

        monkeypatch.setattr(gemv_module, "GEMV_MAX_BYTES", 0)
        monkeypatch.setattr(gemv_module, "stream_gemv", stream)
    path, _ = tiny_model
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompt = [5, 17, 99, 3]
    tokens, logits, decode_logprobs = {}, {}, {}
    calls, embed_calls, logits_calls = [], [], []
    for fused in (False, True):
        llm = LLM(str(path), dtype="float32", progress=False)
        model = llm.runner.model
        model.set_ops(triton_ops() if fused else TORCH_OPS)
        for layer in model.layers if fused else []:
            inner = layer.norm_gemv
            layer.norm_gemv = lambda *a, inner=inner: calls.append(1) or inner(*a)
            inner = layer.embed_norm_gemv
            layer.embed_norm_gemv = lambda *a, inner=inner: embed_calls.append(1) or inner(*a)
        if fused:
            inner = model.norm_logits
            model.norm_logits = lambda *a, inner=inner: logits_calls.append(1) or inner(*a)
        out = llm.generate([prompt], params)[0]
        tokens[fused] = out.token_ids
        decode_logprobs[fused] = [e.logprob for e in out.logprobs]
        logits[fused] = llm.runner.prompt_logits(prompt + tokens[fused], last=1)
    assert calls or streamed, "decode did not take the add+RMSNorm inside the GEMV"
    assert embed_calls, "decode gathered the first layer's row in front of its GEMV"
    assert logits_calls, "decode did not take the final norm inside the lm_head's GEMV"
    assert tokens[True] == tokens[False]
    assert decode_logprobs[True] == pytest.approx(decode_logprobs[False], abs=1e-5)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)
    if streamed:
        # (bias, SiLU·up, norm, embedding row, squares, residual): the first layer's qkv,
        # every later one's, gate_up, and o_proj and down_proj
        assert streamed_calls == {
            (True, False, True, True, False, False), (True, False, True, False, True, False),
            (False, True, True, False, True, False), (False, False, False, False, False, True),
        }  # fmt: skip
