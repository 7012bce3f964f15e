"""Loading safetensors checkpoints: single file, sharded, tied/untied, errors that name the
tensor, dtype casting; loaded parameters equal HF's (fused qkv / gate_up slices included)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_model
from safetensors.torch import load_file, save_file

from nanoqwen import LLM
from nanoqwen.model.load_checkpoint import LoadError, checkpoint_dtype, checkpoint_files


def load(path: Path, dtype: str = "auto") -> LLM:
    return LLM(str(path), dtype=dtype, num_kv_blocks=2, block_size=16, progress=False)


def expected_params(hf_model) -> dict[str, torch.Tensor]:
    """nanoqwen parameter name -> the value HF's separate weights give it."""
    sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
    cfg = hf_model.config
    out = {
        "embed_tokens": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
        "lm_head": sd["lm_head.weight"],  # the embedding itself when tied
    }
    for i in range(cfg.num_hidden_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = hf + "self_attn."
        for kind in ("weight", "bias"):
            out[f"{ours}self_attn.qkv_proj.{kind}"] = torch.cat(
                [sd[f"{attn}{p}_proj.{kind}"] for p in "qkv"]
            )
        out[f"{ours}self_attn.o_proj.weight"] = sd[f"{attn}o_proj.weight"]
        out[f"{ours}mlp.gate_up_proj.weight"] = torch.cat(
            [sd[f"{hf}mlp.gate_proj.weight"], sd[f"{hf}mlp.up_proj.weight"]]
        )
        out[f"{ours}mlp.down_proj.weight"] = sd[f"{hf}mlp.down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{ours}{norm}.weight"] = sd[f"{hf}{norm}.weight"]
    return out


def assert_loaded_equals_hf(llm: LLM, hf_model, dtype: torch.dtype) -> None:
    model = llm.parts.model
    params = dict(model.named_parameters(remove_duplicate=False))
    params["lm_head"] = model.lm_head
    expected = expected_params(hf_model)
    assert set(expected) == set(params)
    for name, value in expected.items():
        assert params[name].dtype == dtype, name
        assert torch.equal(params[name], value.to(dtype)), name
    cfg = hf_model.config
    # The fused slices, one by one, against the separate HF projections.
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    qkv = params["layers.1.self_attn.qkv_proj.weight"]
    hf_attn = hf_model.model.layers[1].self_attn
    assert torch.equal(qkv[:q], hf_attn.q_proj.weight.to(dtype))
    assert torch.equal(qkv[q : q + kv], hf_attn.k_proj.weight.to(dtype))
    assert torch.equal(qkv[q + kv :], hf_attn.v_proj.weight.to(dtype))
    gate_up = params["layers.0.mlp.gate_up_proj.weight"]
    hf_mlp = hf_model.model.layers[0].mlp
    inter = cfg.intermediate_size
    assert torch.equal(gate_up[:inter], hf_mlp.gate_proj.weight.to(dtype))
    assert torch.equal(gate_up[inter:], hf_mlp.up_proj.weight.to(dtype))


def copy_checkpoint(src: Path, dst: Path, edit=None) -> Path:
    """Copies a single-file checkpoint dir; edit(tensors) may change the tensors dict."""
    shutil.copytree(src, dst)
    if edit is not None:
        tensors = load_file(dst / "model.safetensors")
        edit(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    path = tmp_path_factory.mktemp("untied")
    return path, write_tiny_model(path, tie_word_embeddings=False, seed=1)


# ---- layouts -----------------------------------------------------------------------------------
def test_single_file_tied(tiny_model):
    path, hf = tiny_model
    assert checkpoint_files(path) == [path / "model.safetensors"]
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    llm = load(path)
    assert llm.parts.model.lm_head is llm.parts.model.embed_tokens
    assert_loaded_equals_hf(llm, hf, torch.float32)


def test_single_file_untied(untied):
    path, hf = untied
    assert "lm_head.weight" in load_file(path / "model.safetensors")
    llm = load(path)
    model = llm.parts.model
    assert model.lm_head is not model.embed_tokens
    assert not torch.equal(model.lm_head, model.embed_tokens)
    assert_loaded_equals_hf(llm, hf, torch.float32)


def test_sharded_by_save_pretrained(tiny_model, tmp_path):
    path, hf = tiny_model
    out = tmp_path / "sharded"
    shutil.copytree(path, out, ignore=shutil.ignore_patterns("model.safetensors"))
    hf.save_pretrained(out, max_shard_size="150KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    assert checkpoint_files(out) == [out / s for s in dict.fromkeys(index["weight_map"].values())]
    assert_loaded_equals_hf(load(out), hf, torch.float32)


def split_into_shards(src: Path, dst: Path, num_shards: int) -> list[str]:
    """Round-robin over sorted names, so q/k/v and gate/up of a layer land in different
    shards; writes the index HF writes."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(src / "model.safetensors")
    names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    shards: list[dict] = [{} for _ in names]
    weight_map = {}
    for i, key in enumerate(sorted(tensors)):
        shards[i % num_shards][key] = tensors[key]
        weight_map[key] = names[i % num_shards]
    for name, shard in zip(names, shards):
        save_file(shard, dst / name, metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return names


@pytest.mark.parametrize("num_shards", [2, 3])
def test_sharded_by_hand_untied(untied, tmp_path, num_shards):
    path, hf = untied
    out = tmp_path / "sharded"
    names = split_into_shards(path, out, num_shards)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for fused in (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("mlp.gate_proj", "mlp.up_proj"),
    ):
        assert len({weight_map[f"model.layers.0.{p}.weight"] for p in fused}) > 1
    assert checkpoint_files(out) == [out / n for n in names]
    assert_loaded_equals_hf(load(out), hf, torch.float32)


def test_missing_shard_is_named(untied, tmp_path):
    out = tmp_path / "sharded"
    names = split_into_shards(untied[0], out, 3)
    (out / names[1]).unlink()
    with pytest.raises(LoadError, match=rf"^checkpoint shard {out / names[1]} is missing$"):
        load(out)


def test_no_weights_at_all(tiny_model, tmp_path):
    out = tmp_path / "empty"
    shutil.copytree(tiny_model[0], out, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(LoadError, match="has neither model.safetensors nor"):
        load(out)


# ---- unreadable files: one line naming the file ------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "empty", "zero-filled", "garbage header"])
def test_a_damaged_safetensors_file_is_named(tiny_model, tmp_path, damage):
    out = copy_checkpoint(tiny_model[0], tmp_path / "ckpt")
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(
        {
            "truncated": data[: len(data) - 100],
            "empty": b"",
            "zero-filled": bytes(len(data)),
            "garbage header": data[:8] + b"{not json" + data[17:],
        }[damage]
    )
    with pytest.raises(LoadError) as info:
        load(out)
    message = str(info.value)
    assert message.startswith(f"{weights} is not a readable safetensors file (")
    assert message.endswith("allowed a complete safetensors file, as save_pretrained writes it")
    assert "\n" not in message


def test_a_tensor_of_integers_is_refused(tiny_model, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"

    def to_int(tensors):
        tensors[name] = tensors[name].to(torch.int32)

    out = copy_checkpoint(tiny_model[0], tmp_path / "ckpt", to_int)
    with pytest.raises(LoadError) as info:
        load(out)
    assert str(info.value) == (
        f"tensor {name} in model.safetensors has dtype I32: allowed F32, F16, BF16"
    )


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ("{not json", "is not valid JSON (Expecting property name"),
        ("[]", "holds a list: allowed a JSON object"),
        ("{}", 'has no "weight_map" object naming the shards'),
        ('{"weight_map": {"a": 3}}', 'the "weight_map" values must be shard file names'),
    ],
)
def test_a_bad_shard_index_is_named(untied, tmp_path, index, message):
    out = tmp_path / "sharded"
    split_into_shards(untied[0], out, 2)
    (out / "model.safetensors.index.json").write_text(index)
    with pytest.raises(LoadError) as info:
        load(out)
    assert str(info.value).startswith(str(out / "model.safetensors.index.json"))
    assert message in str(info.value)


# ---- errors that name the tensor ---------------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.self_attn.k_proj.bias",
        "model.layers.0.mlp.up_proj.weight",
        "model.norm.weight",
        "model.embed_tokens.weight",
    ],
)
def test_missing_tensor_is_named(tiny_model, tmp_path, name):
    out = copy_checkpoint(tiny_model[0], tmp_path / "ckpt", lambda t: t.pop(name))
    with pytest.raises(LoadError) as info:
        load(out)
    assert str(info.value) == f"checkpoint lacks tensor {name}"


def test_missing_lm_head_of_untied_model_is_named(untied, tmp_path):
    def drop(tensors):
        tensors.pop("lm_head.weight")
        tensors.pop("model.layers.0.self_attn.o_proj.weight")

    out = copy_checkpoint(untied[0], tmp_path / "ckpt", drop)
    with pytest.raises(LoadError) as info:
        load(out)
    # Sorted names: the first is reported, with a count of the rest.
    assert str(info.value) == "checkpoint lacks tensor lm_head.weight (and 1 more)"


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        ("model.layers.0.mlp.up_proj.weight", (95, 64), (96, 64)),
        ("model.layers.1.self_attn.q_proj.weight", (64, 63), (64, 64)),
        ("model.layers.1.self_attn.v_proj.bias", (64,), (32,)),
        ("model.embed_tokens.weight", (511, 64), (512, 64)),
        ("model.layers.0.input_layernorm.weight", (64, 1), (64,)),
    ],
)
def test_misshaped_tensor_names_tensor_and_both_shapes(tiny_model, tmp_path, name, shape, expected):
    def reshape(tensors):
        tensors[name] = torch.zeros(shape)

    out = copy_checkpoint(tiny_model[0], tmp_path / "ckpt", reshape)
    with pytest.raises(LoadError) as info:
        load(out)
    assert str(info.value) == f"tensor {name} has shape {shape}, expected {expected}"


def test_unexpected_tensor_is_named(tiny_model, tmp_path):
    def add(tensors):
        tensors["model.layers.7.mlp.up_proj.weight"] = torch.zeros(96, 64)

    out = copy_checkpoint(tiny_model[0], tmp_path / "ckpt", add)
    with pytest.raises(LoadError, match=r"unexpected tensor model\.layers\.7\.mlp\.up_proj"):
        load(out)


def test_tied_checkpoint_with_an_lm_head_copy_loads(tiny_model, tmp_path):
    """Some tied checkpoints store lm_head.weight anyway: it is skipped."""

    def add(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    out = copy_checkpoint(tiny_model[0], tmp_path / "ckpt", add)
    assert_loaded_equals_hf(load(out), tiny_model[1], torch.float32)


# ---- dtypes ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("auto", torch.float32),  # auto is float32 on CPU
    ],
)
def test_dtype_casting(untied, dtype, expected):
    path, hf = untied
    llm = load(path, dtype)
    assert_loaded_equals_hf(llm, hf, expected)
    assert llm.parts.model.rotary.cos_half.dtype == torch.float32


@pytest.fixture(scope="module")
def bf16_checkpoint(untied, tmp_path_factory):
    path, hf = untied
    out = tmp_path_factory.mktemp("bf16")
    shutil.copytree(path, out, dirs_exist_ok=True)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(path / "model.safetensors").items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out, hf


@pytest.mark.parametrize(
    ("dtype", "expected"), [("auto", torch.float32), ("bfloat16", torch.bfloat16)]
)
def test_bfloat16_checkpoint(bf16_checkpoint, dtype, expected):
    path, hf = bf16_checkpoint
    assert checkpoint_dtype(path) == torch.bfloat16
    llm = load(path, dtype)
    params = dict(llm.parts.model.named_parameters())
    for name, value in expected_params(hf).items():
        # Stored as bf16, then cast: exactly HF's weights rounded to bf16.
        assert torch.equal(params[name], value.to(torch.bfloat16).to(expected)), name


def test_checkpoint_dtype_of_float32_and_float16(tiny_model, tmp_path):
    assert checkpoint_dtype(tiny_model[0]) == torch.float32

    def half(tensors):
        for k in tensors:
            tensors[k] = tensors[k].half()

    out = copy_checkpoint(tiny_model[0], tmp_path / "fp16", half)
    assert checkpoint_dtype(out) == torch.float16


def test_unknown_dtype_is_refused(tiny_model):
    with pytest.raises(ValueError, match=r"^dtype='float8' is unknown: allowed auto, float32"):
        load(tiny_model[0], "float8")
