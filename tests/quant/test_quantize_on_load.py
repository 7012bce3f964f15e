"""quantization="int8"|"int4" on a float checkpoint: every linear layer and the lm_head are
swapped for QuantizedLinear, and in float32 the model computes exactly what the same model
with those weights dequantized into dense layers computes."""

from __future__ import annotations

import pytest
import torch

from nanoqwen import LLM, InvalidInputError, SamplingParams
from nanoqwen.quant.format import dequantize
from nanoqwen.quant.linear import QuantizedLinear
from nanoqwen.quant.scheme import SCHEMES


def _engine(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", num_kv_blocks=16, block_size=16, progress=False, **kw)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_model_equals_its_dequantized_twin(tiny_model, quantization):
    path, _ = tiny_model
    quant = _engine(path, quantization=quantization)
    layers = {n: m for n, m in quant.runner.model.named_modules() if isinstance(m, QuantizedLinear)}
    cfg = quant.config
    assert len(layers) == 4 * cfg.num_hidden_layers + 1 and "lm_head" in layers

    twin = _engine(path)  # float weights, then each replaced by its quantized-dequantized self
    net = twin.runner.model
    scheme = SCHEMES[quantization]
    with torch.no_grad():
        for name in layers:
            if name == "lm_head":
                net.lm_head = torch.nn.Parameter(dequantize(scheme.apply(net.lm_head)), False)
            else:
                w = net.get_submodule(name).weight
                w.copy_(dequantize(scheme.apply(w)))
    ids = [5, 17, 99, 3, 250, 41, 8, 8, 120, 7]
    for rows in (len(ids), 1):  # a prefill (many rows), then a single-row (decode) shape
        got = quant.runner.prompt_logits(ids[:rows] if rows > 1 else ids[:2], 1)
        ref = twin.runner.prompt_logits(ids[:rows] if rows > 1 else ids[:2], 1)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=8)
    assert quant.generate([ids], params)[0].token_ids == twin.generate([ids], params)[0].token_ids


def test_auto_leaves_a_float_checkpoint_float(tiny_model):
    llm = _engine(tiny_model[0])
    assert not any(isinstance(m, QuantizedLinear) for m in llm.runner.model.modules())


def test_unknown_quantization_is_refused(tiny_model):
    with pytest.raises(InvalidInputError, match="quantization='int3'"):
        _engine(tiny_model[0], quantization="int3")
