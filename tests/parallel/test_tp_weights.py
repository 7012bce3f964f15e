"""Each rank loads only its part of the checkpoint, and the parts make up the whole; a
tensor_parallel_size the model cannot be split over is refused before anything starts."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from conftest import write_tiny_model

from nanoqwen import LLM
from nanoqwen.errors import InvalidInputError
from nanoqwen.model import load_checkpoint
from nanoqwen.model.config import ModelConfig
from nanoqwen.model.qwen2 import Qwen2ForCausalLM
from nanoqwen.model.tensor_parallel import TensorParallel


def load_rank(path, rank: int, size: int) -> Qwen2ForCausalLM:
    cfg = ModelConfig.from_file(path / "config.json")
    model = Qwen2ForCausalLM(cfg, torch.float32, "cpu", TensorParallel(rank, size))
    load_checkpoint.load_weights(model, path, progress=False)
    return model


@pytest.mark.parametrize("size", [2, 4])
def test_rank_slices_reassemble_to_the_checkpoint(tmp_path, size):
    hf = write_tiny_model(
        tmp_path, vocab_size=509, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=96, tie_word_embeddings=False,
    )  # fmt: skip
    want = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    ranks = [load_rank(tmp_path, r, size) for r in range(size)]
    cfg = ranks[0].config  # one rank's shapes
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (8 // size, 4 // size)
    for i in range(2):
        layer = [m.layers[i] for m in ranks]
        attn = [m.self_attn for m in layer]
        q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        qkv = [a.qkv_proj.weight for a in attn]  # each rank: [its q | its k | its v]
        bias = [a.qkv_proj.bias for a in attn]
        p = f"layers.{i}."
        assert torch.equal(torch.cat([w[:q] for w in qkv]), want[p + "self_attn.q_proj.weight"])
        assert torch.equal(
            torch.cat([w[q : q + kv] for w in qkv]), want[p + "self_attn.k_proj.weight"]
        )  # noqa: E501
        assert torch.equal(
            torch.cat([w[q + kv :] for w in qkv]), want[p + "self_attn.v_proj.weight"]
        )  # noqa: E501
        assert torch.equal(
            torch.cat([b[q + kv :] for b in bias]), want[p + "self_attn.v_proj.bias"]
        )  # noqa: E501
        o = torch.cat([a.o_proj.weight for a in attn], dim=1)
        assert torch.equal(o, want[p + "self_attn.o_proj.weight"])
        gate_up = [m.mlp.gate_up_proj.weight for m in layer]
        assert torch.equal(
            torch.cat([w[:inter] for w in gate_up]), want[p + "mlp.gate_proj.weight"]
        )  # noqa: E501
        assert torch.equal(torch.cat([w[inter:] for w in gate_up]), want[p + "mlp.up_proj.weight"])  # noqa: E501
        down = torch.cat([m.mlp.down_proj.weight for m in layer], dim=1)
        assert torch.equal(down, want[p + "mlp.down_proj.weight"])
        norm = want[p + "input_layernorm.weight"]
        assert all(torch.equal(m.input_layernorm.weight, norm) for m in layer)
    shard = -(-509 // size)
    for ours, theirs in (("embed_tokens", "embed_tokens.weight"), ("lm_head", "lm_head.weight")):
        rows = torch.cat([getattr(m, ours) for m in ranks])
        assert rows.shape == (shard * size, 64)
        assert torch.equal(rows[:509], want[theirs])
        assert not rows[509:].any()  # the last shard's padding


def test_split_tensors_are_read_as_slices(tmp_path, monkeypatch):
    """get_tensor (a whole tensor) only for what every rank holds whole: the norms."""
    write_tiny_model(tmp_path, tie_word_embeddings=False)
    whole: list[str] = []
    real_open = load_checkpoint._open

    class Recording:
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def get_tensor(self, name):
            whole.append(name)
            return self.f.get_tensor(name)

    def recording_open(path):
        cm = real_open(path)

        class Wrap:
            def __enter__(self):
                return Recording(cm.__enter__())

            def __exit__(self, *exc):
                return cm.__exit__(*exc)

        return Wrap()

    monkeypatch.setattr(load_checkpoint, "_open", recording_open)
    load_rank(tmp_path, 1, 2)
    assert whole and all(name.endswith("layernorm.weight") or name == "model.norm.weight"
                         for name in whole), whole  # fmt: skip


@pytest.mark.parametrize(
    ("size", "shape", "problem"),
    [
        (3, {}, "num_key_value_heads=2"),
        (4, {}, "num_key_value_heads=2"),
        (2, {"intermediate_size": 97}, "intermediate_size=97"),
    ],
)
def test_a_size_that_does_not_divide_the_model_is_refused(tmp_path, size, shape, problem):
    write_tiny_model(tmp_path, **shape)
    with pytest.raises(InvalidInputError, match=problem) as err:
        LLM(str(tmp_path), tensor_parallel_size=size, progress=False)
    assert err.value.param == "tensor_parallel_size"
    assert "allowed a tensor_parallel_size that divides" in str(err.value)
    assert multiprocessing.active_children() == []  # refused before any rank started


@pytest.mark.parametrize("size", [0, -1, 1.5, "2"])
def test_a_size_that_is_not_a_positive_integer_is_refused(tiny_model, size):
    with pytest.raises(InvalidInputError, match="tensor_parallel_size"):
        LLM(str(tiny_model[0]), tensor_parallel_size=size, progress=False)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_are_refused_with_two_ranks(tiny_model, quantization):
    with pytest.raises(InvalidInputError, match="quantized weights") as err:
        LLM(str(tiny_model[0]), tensor_parallel_size=2, quantization=quantization,
            progress=False)  # fmt: skip
    assert err.value.param == "tensor_parallel_size"
    assert multiprocessing.active_children() == []
