"""A model whose qkv and gate_up are int4 on the tensor-core GEMV (the CUDA layout, packed for
Triton's CPU interpreter): at one row each decoder layer runs its add+RMSNorm inside those
GEMVs (QuantizedLinear.norm_row), and decodes what the separate norm kernels decode."""

from __future__ import annotations

import os

import pytest
from conftest import write_tiny_model

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter"
)
from nanoqwen.kernels.layer_ops import triton_ops  # noqa: E402
from nanoqwen.model.qwen2 import DecoderLayer  # noqa: E402
from nanoqwen.quant.format import quantize_int4  # noqa: E402
from nanoqwen.quant.linear import QuantizedLinear, cuda_pack  # noqa: E402


@pytest.fixture(scope="module")
def int4_model(tmp_path_factory):
    """A tiny checkpoint wide enough for groups of 128 (hidden 256, MLP 256)."""
    path = tmp_path_factory.mktemp("tiny-int4")
    write_tiny_model(path, hidden_size=256, intermediate_size=256, num_attention_heads=4)
    return path


def quantize_qkv_and_gate_up(llm) -> None:
    for layer in llm.runner.model.layers:
        for owner, name in ((layer.self_attn, "qkv_proj"), (layer.mlp, "gate_up_proj")):
            old = getattr(owner, name)
            bias = None if old.bias is None else old.bias.detach()
            new = QuantizedLinear(quantize_int4(old.weight.detach(), 128), bias)
            new._decode, new.kind = (cuda_pack(new.weight),), "triton"
            setattr(owner, name, new)
        layer.mlp.gemv = False


def test_int4_layers_take_the_norm_inside_their_gemv(int4_model, monkeypatch):
    from nanoqwen import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompt = [5, 17, 99, 3]
    fused_calls = []
    norm_row = QuantizedLinear.norm_row

    def counted(self, *args):
        fused_calls.append(args[-1])  # silu_mul: qkv False, gate_up True
        return norm_row(self, *args)

    tokens, logprobs = {}, {}
    for fused in (False, True):
        llm = LLM(str(int4_model), dtype="float32", progress=False)
        llm.runner.model.set_ops(triton_ops())
        quantize_qkv_and_gate_up(llm)
        if fused:
            monkeypatch.setattr(QuantizedLinear, "norm_row", counted)
        else:
            monkeypatch.setattr(DecoderLayer, "_norm_into", lambda self, *a: None)
        out = llm.generate([prompt], params)[0]
        monkeypatch.undo()
        tokens[fused] = out.token_ids
        logprobs[fused] = [e.logprob for e in out.logprobs]
    # qkv then gate_up (silu_mul) in each of the 2 layers, for each of the 5 decode steps
    assert fused_calls == [False, True] * 2 * 5
    assert tokens[True] == tokens[False]
    assert logprobs[True] == pytest.approx(logprobs[False], abs=1e-5)
