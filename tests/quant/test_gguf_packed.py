"""GGUF Q5_0/Q8_0 (and Q4_0) tensors loaded straight into the CPU kernels' layout
(quant/gguf_packed.py)
give exactly what the canonical route gives (unpacked to int8 codes, then packed by
gguf_forms.pack_q5_0 / pack_q8_0): the same packed bytes, the same per-channel int8 copy for
prefill, the same kernel choice per layer, fused projections included, and so the same
greedy tokens. The K-quants load as their file's superblocks, which the canonical route has
no packing for."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_gguf import K_QUANTS, WITH_MINS, random_blocks, write_gguf

from nanoqwen import LLM, SamplingParams
from nanoqwen.kernels.cpu.gguf import gguf_kernel
from nanoqwen.model import load_gguf
from nanoqwen.quant import linear
from nanoqwen.quant.format import cat_rows, dequantize, requantize_per_channel
from nanoqwen.quant.gguf_blocks import BLOCK_SIZES, from_gguf_blocks
from nanoqwen.quant.gguf_forms import (
    is_q5_0,
    pack_q5_0,
    pack_q8_0,
    requantize_packed,
    requantize_rows,
)
from nanoqwen.quant.gguf_packed import (
    PackedBlocks,
    PackedParts,
    as_q5_0,
    as_q8_0,
    cat_packed,
    from_file,
    keeps_file_blocks,
    to_canonical,
)
from nanoqwen.quant.linear import QuantizedLinear, decode_arithmetic, int8_matmul_is_fast
from nanoqwen.quant.scheme import SCHEMES

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(
    gguf_kernel() is None, reason="no C compiler or no AVX2: the GGUF kernels are not built"
)
CPU = torch.device("cpu")


def _random_blocks(type_name: str, n: int, k: int, seed: int, small: bool = False) -> np.ndarray:
    """Raw rows of blocks with random codes (all 256 byte values; -16..15 only if `small`)
    and finite float16 scales of both signs: layouts beyond what a quantizer writes."""
    rng = np.random.default_rng(seed)
    size = {"Q5_0": 22, "Q8_0": 34, "Q4_0": 18}[type_name]
    b = rng.integers(0, 256, (n, k // 32, size), dtype=np.uint8)
    if small:
        b[..., 2:] = rng.integers(-16, 16, b[..., 2:].shape).astype(np.int8).view(np.uint8)
    d = (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16)
    b[..., 0:2] = d.view(np.uint8).reshape(n, k // 32, 2)
    return b.reshape(n, -1)


def _quantized(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])


def _old_pack(w) -> tuple[torch.Tensor, ...]:
    """What QuantizedLinear.prepare packs a canonical Q5_0/Q8_0-form weight into."""
    return pack_q5_0(w) if is_q5_0(w) else pack_q8_0(w)


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    """Equal dtypes, shapes and bytes (NaN-safe, -0.0 told from 0.0)."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(a, b)
    )


def _cases() -> list[tuple[str, np.ndarray]]:
    return [
        ("Q5_0", _quantized("Q5_0", 40, 256, seed=0)),
        ("Q8_0", _quantized("Q8_0", 40, 256, seed=1)),
        ("Q5_0", _random_blocks("Q5_0", 24, 96, seed=2)),  # an odd number of blocks
        ("Q8_0", _random_blocks("Q8_0", 24, 96, seed=3)),  # code -128 included
        ("Q8_0", _random_blocks("Q8_0", 24, 64, seed=4, small=True)),  # Q5_0's codes only
        ("Q4_0", _quantized("Q4_0", 40, 256, seed=5)),  # the canonical route packs it as Q5_0
        ("Q4_0", _random_blocks("Q4_0", 24, 96, seed=6)),
    ]


@pytest.mark.parametrize(("type_name", "raw"), _cases())
def test_direct_packing_equals_unpack_and_repack(type_name, raw):
    canonical = from_gguf_blocks(type_name, raw)
    packed = from_file(type_name, raw)
    # Q4_0 keeps its file's blocks (4.5 bits a weight), which are Q5_0's, exactly, less qh.
    assert packed.kind == "q4_0" if type_name == "Q4_0" else packed.kind in ("q5_0", "q8_0")
    assert _same(as_q5_0(packed).tensors if type_name == "Q4_0" else packed.tensors,
                 _old_pack(canonical))  # fmt: skip
    assert as_q8_0(packed).kind == "q8_0" and _same(as_q8_0(packed).tensors, pack_q8_0(canonical))
    assert type_name == "Q4_0" or packed.kind == ("q5_0" if is_q5_0(canonical) else "q8_0")
    assert packed.shape == canonical.shape
    back = to_canonical(packed)
    assert torch.equal(back.q, canonical.q) and torch.equal(back.scale, canonical.scale)
    # The prefill copy: C from the blocks == C from the codes (what prepare computed) == torch
    # from the codes, but where a code is -128 (never in a quantizer's Q8_0), whose int8 abs
    # overflows in torch.
    fast = requantize_packed(packed.kind, packed.tensors)  # Q4_0's: its own C decoding
    others = [requantize_rows(canonical)]
    others += [requantize_per_channel(canonical)] if int(canonical.q.min()) > -128 else []
    for other in others:
        assert torch.equal(fast.q, other.q) and torch.equal(fast.scale, other.scale)


@pytest.mark.parametrize(
    "types",
    [
        ("Q5_0", "Q5_0", "Q5_0"),
        ("Q5_0", "Q5_0", "Q8_0"),
        ("Q8_0", "Q5_0"),
        ("Q4_0", "Q5_0"),
        ("Q4_0", "Q4_0", "Q8_0"),
        ("Q4_0", "Q4_0"),
    ],  # qkv, gate_up
)
def test_fused_parts_equal_the_packed_concatenation(types):
    """All Q4_0 parts stay Q4_0 (the canonical route packs them as Q5_0, which the fused
    blocks are, less qh); beside Q5_0 they go to Q5_0's layout, beside Q8_0 to Q8_0's."""
    raws = [_quantized(t, 8 * (i + 1), 128, seed=10 + i) for i, t in enumerate(types)]
    parts = [from_file(t, raw) for t, raw in zip(types, raws)]
    old = _old_pack(cat_rows([from_gguf_blocks(t, raw) for t, raw in zip(types, raws)]))
    fused = cat_packed(parts)
    assert fused.kind == ("q4_0" if set(types) == {"Q4_0"} else old_kind(old))
    assert _same(as_q5_0(fused).tensors if fused.kind == "q4_0" else fused.tensors, old)


def old_kind(packed: tuple[torch.Tensor, ...]) -> str:
    return "q5_0" if len(packed) == 3 else "q8_0"


def test_layouts_prepare_would_not_pack_take_the_canonical_route():
    assert from_file("Q5_0", _quantized("Q5_0", 8, 32, seed=0)) is None  # per-channel int8
    nan = _random_blocks("Q8_0", 8, 64, seed=0)
    nan[3, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)  # not Q8_0's form
    assert from_file("Q8_0", nan) is None
    for type_name, size, at in (("Q6_K", 210, 208), ("Q4_K", 144, 2), ("Q5_K", 176, 2),
                                ("Q3_K", 110, 108), ("Q2_K", 84, 82), ("Q4_1", 20, 2),
                                ("Q5_1", 24, 2)):  # fmt: skip
        nan = np.zeros((8, size), dtype=np.uint8)
        nan[5, at : at + 2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
        assert from_file(type_name, nan) is None


@pytest.mark.parametrize("type_name", K_QUANTS + WITH_MINS)
def test_k_quants_load_as_the_files_superblocks(type_name):
    """The K-quants go to the kernels as the file's bytes (Q6_K: 6.56 bits a weight, where
    Q8_0's form of it took 8.5 and rounded it again; Q4_K: 4.63, where torch's int4 kernel
    read 5; Q5_K: 5.63, where Q8_0's form of it read 8.5; Q3_K: 3.56, where Q6_K's layout of
    it read 6.56; Q2_K: 2.63, where Q8_0's form of it read 8.5): the canonical weight they
    hold is the file's (which dequantizes as gguf-py's reference does), and the layer's int8
    prefill copy is what prepare makes of that weight."""
    raw = random_blocks(type_name, 16, 512, seed=4)
    packed = from_file(type_name, raw)
    canonical = from_gguf_blocks(type_name, raw)
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    assert torch.equal(dequantize(canonical), torch.from_numpy(reference))
    mine = to_canonical(packed)
    for a, b in ((mine.q, canonical.q), (mine.scale, canonical.scale)):
        assert torch.equal(a, b)
    assert (mine.offset is None) == (canonical.offset is None)
    assert mine.offset is None or torch.equal(mine.offset, canonical.offset)
    assert packed.shape == (16, 512)
    assert (packed.bits, packed.group_size) == (canonical.bits, canonical.group_size)
    layer = QuantizedLinear(packed, None)
    layer.prepare(torch.bfloat16)
    assert layer.kind == packed.kind == type_name.lower()
    symmetric = type_name in ("Q6_K", "Q3_K")  # groups of 16, no offset
    want = requantize_rows(canonical) if symmetric else requantize_per_channel(canonical)
    assert (layer._int8 is not None) == int8_matmul_is_fast()  # else prefill runs the kernels
    assert _same(layer._packed_int8(), (want.q, want.scale.view(-1)))
    # In a fused projection beside another layout each keeps its own blocks (PackedParts).
    q5 = from_file("Q5_0", _random_blocks("Q5_0", 16, 512, seed=5, small=True))
    fused = load_gguf._fuse([q5, packed])
    assert isinstance(fused, PackedParts) and fused.kind == f"q5_0+{packed.kind}"


def test_a_fused_projection_keeps_each_parts_kernel_where_layouts_differ():
    """qkv of Q4_K q and k and a Q6_K v, as llama.cpp's Q4_K_M files have it in some
    layers: q and k stack into one Q4_K part, v keeps Q6_K. Decode runs each part's kernel
    (with its slice of the bias); prefill multiplies the parts' per-channel int8 copies,
    stacked, which is the copy the canonical route made (a copy per row)."""
    types = ["Q4_K", "Q4_K", "Q6_K"]
    raws = [random_blocks(t, n, 512, seed=20 + n) for t, n in zip(types, (32, 16, 16))]
    parts = [from_file(t, raw) for t, raw in zip(types, raws)]
    fused = load_gguf._fuse(parts)
    assert isinstance(fused, PackedParts) and fused.shape == (64, 512)
    assert [p.kind for p in fused.parts] == ["q4_k", "q6_k"]
    gate_up = load_gguf._fuse(parts[:2])  # two Q4_K parts stack into one
    assert isinstance(gate_up, PackedBlocks) and gate_up.kind == "q4_k"
    bias = (torch.randn(64) * 0.1).to(torch.bfloat16)
    layer = QuantizedLinear(fused, bias)
    layer.prepare(torch.bfloat16)
    assert layer.layout == "parts (q4_k+q6_k)"
    assert layer.decode_bytes() == sum(t.nbytes for p in fused.parts for t in p.tensors) + 128
    alone = [QuantizedLinear(p, b) for p, b in zip(fused.parts, bias.split([48, 16]))]
    for a in alone:
        a.prepare(torch.bfloat16)
    canonical = [from_gguf_blocks(t, raw) for t, raw in zip(types, raws)]
    old = cat_rows([SCHEMES["int8"].apply(c) for c in canonical])
    assert _same(layer._packed_int8(), (old.q, old.scale.view(-1)))
    # decode's kernels, then past 16 rows the prefill's int8 matmul (without VNNI or AMX,
    # the kernels again, 16 rows at a time)
    for rows in (1, 3, 17):
        x = torch.randn(rows, 512).to(torch.bfloat16)
        assert torch.equal(layer(x), torch.cat([a(x) for a in alone], dim=-1)), rows
        half = x.half()
        assert torch.equal(layer(half), torch.cat([a(half) for a in alone], dim=-1)), rows


@pytest.mark.parametrize("type_name", K_QUANTS + WITH_MINS)
@pytest.mark.parametrize(("n", "k"), [(3, 256), (33, 4864)])
def test_k_quant_prefill_copies_from_the_superblocks_equal_the_canonical_routes(type_name, n, k):
    """requantize_packed reads the superblocks in C; the canonical route decodes them in
    numpy and requantizes in torch (Q4_K, Q5_K) or C (Q6_K). Bit for bit the same, a row
    whose scales are all zero included (row scale 0, codes 0)."""
    raw = random_blocks(type_name, n, k, seed=n)
    zero = raw.reshape(n, k // BLOCK_SIZES[type_name][0], -1)
    scales = {"Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82)}  # d (and dmin) of row 1
    for at in scales.get(type_name, (0, 2)):
        zero[1, :, at : at + 2] = 0
    canonical = from_gguf_blocks(type_name, raw)
    symmetric = type_name in ("Q6_K", "Q3_K")
    want = requantize_rows(canonical) if symmetric else requantize_per_channel(canonical)
    packed = from_file(type_name, raw)
    got = requantize_packed(packed.kind, packed.tensors)
    assert _same((got.q, got.scale), (want.q, want.scale))
    assert float(got.scale[1]) == 0.0 and not got.q[1].any()


def test_only_the_cpu_kernels_schemes_load_directly():
    blocks = SCHEMES["gguf-blocks"]
    assert keeps_file_blocks(blocks, CPU, torch.bfloat16)
    assert keeps_file_blocks(blocks, CPU, torch.float16)
    assert not keeps_file_blocks(blocks, CPU, torch.float32)  # the exact mode dequantizes
    assert not keeps_file_blocks(blocks, torch.device("cuda", 0), torch.bfloat16)
    assert not keeps_file_blocks(SCHEMES["gguf"], CPU, torch.bfloat16)
    assert not keeps_file_blocks(None, CPU, torch.bfloat16)
    layer = QuantizedLinear(from_file("Q5_0", _quantized("Q5_0", 8, 64, seed=0)), None)
    with pytest.raises(ValueError, match="bf16/fp16 activations"):
        layer.prepare(torch.float32)


# ---- a whole model: a synthetic GGUF loaded both ways ---------------------------------------

# Layer 0: v_proj Q8_0 next to Q5_0 q/k (fused as Q8_0, as in the real file), down_proj Q8_0
# over 3 blocks a row; layer 1: up_proj float16 next to a Q5_0 gate_proj (canonical route).
TYPES = {
    "model.embed_tokens.weight": "Q5_0",
    "lm_head.weight": "Q8_0",
    "model.layers.0.self_attn.v_proj.weight": "Q8_0",
    "model.layers.0.mlp.down_proj.weight": "Q8_0",
    "model.layers.1.mlp.up_proj.weight": "F16",
}


def _engine(path) -> LLM:
    return LLM(str(path), device="cpu", dtype="bfloat16", num_kv_blocks=16, block_size=16,
               swap_space=0, progress=False)  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
def test_model_loads_the_same_layers_and_tokens_either_way(tmp_path, monkeypatch, tied):
    path = write_gguf(tmp_path, tied, TYPES)
    packed: list[str] = []
    direct_from_file = load_gguf.from_file

    def spy(type_name, data):
        found = direct_from_file(type_name, data)
        packed.extend([type_name] if isinstance(found, PackedBlocks) else [])
        return found

    monkeypatch.setattr(load_gguf, "from_file", spy)
    new = _engine(path)
    assert sorted(set(packed)) == ["Q5_0", "Q8_0"]  # the direct path ran for both types
    monkeypatch.setattr(load_gguf, "keeps_file_blocks", lambda *args: False)
    old = _engine(path)
    # Teacher-forced logits of every position: the lm_head's first many-row call, which
    # makes its int8 copy (prepare left it out; without VNNI or AMX the kernels take the
    # rows 16 at a time and no copy is made) and must equal the canonical route's.
    assert new.runner.model.lm_head._int8 is None
    prompt = [5, 17, 99, 3, 250, 41, 8, 8, 120, 7] * 2  # past the few-row kernel's 16
    assert torch.equal(new.runner.prompt_logits(prompt), old.runner.prompt_logits(prompt))
    assert (new.runner.model.lm_head._int8 is not None) == int8_matmul_is_fast()

    layers = {n: m for n, m in old.runner.model.named_modules() if isinstance(m, QuantizedLinear)}
    ours = {n: m for n, m in new.runner.model.named_modules() if isinstance(m, QuantizedLinear)}
    assert ours.keys() == layers.keys() and "lm_head" in ours
    for name, layer in layers.items():
        mine = ours[name]
        assert (mine.kind, mine.bits, mine.group_size) == (layer.kind, layer.bits, layer.group_size)
        assert _same(mine._decode, layer._decode), name
        assert _same(mine._int8 or (), layer._int8 or ()), name
        assert (mine.bias is None) == (layer.bias is None)
        assert mine.bias is None or torch.equal(mine.bias, layer.bias)
    kinds = {m.kind for m in ours.values()}
    assert {"q5_0", "q8_0"} <= kinds  # the fused Q5_0 + Q8_0 qkv packs as Q8_0

    prompts = [[5, 17, 99, 3, 250, 41, 8, 8, 120, 7], [300, 12]]  # prefill and decode shapes
    params = SamplingParams(temperature=0, max_tokens=12)
    got = [o.token_ids for o in new.generate(prompts, params)]
    assert got == [o.token_ids for o in old.generate(prompts, params)]


def k_types(main: str) -> dict[str, str]:
    """A Q4_K_M-like (main "Q4_K") or Q5_K_M-like ("Q5_K") file of 256-value superblocks:
    q, k, o, gate, up in main; layer 0's v and down Q6_K, as llama.cpp's mixes give some
    layers."""
    return {
        "model.embed_tokens.weight": "Q8_0",
        "lm_head.weight": "Q6_K",
        **{f"model.layers.{i}.self_attn.{p}_proj.weight": main for i in (0, 1) for p in "qkvo"},
        **{f"model.layers.{i}.mlp.{p}_proj.weight": main for i in (0, 1) for p in ("gate", "up")},
        "model.layers.0.self_attn.v_proj.weight": "Q6_K",
        "model.layers.0.mlp.down_proj.weight": "Q6_K",
        "model.layers.1.mlp.down_proj.weight": main,
    }


@pytest.mark.parametrize(
    ("main", "layout"),
    [
        ("Q4_K", "int4 group 32"),
        ("Q5_K", "int8 group 32"),
        ("Q3_K", "int8 group 16"),
        ("Q2_K", "int8 group 16"),
        ("Q4_1", "int4 group 32"),
        ("Q5_1", "int8 group 32"),
    ],
)
def test_a_k_quant_model_runs_every_layer_on_the_files_blocks(tmp_path, main, layout):
    """Every projection keeps its file's blocks, a fused one with two layouts as parts
    (before, any fused projection with a K-quant part took the canonical route: torch's
    int4 kernel, or per-channel int8 of the float weight; Q5_K was not read at all and went
    to Q8_0's form). Decode's logits (3 rows a call: the file's kernels) against the exact
    float32 dequantized model, 12 rows: measured mean |gap| 0.046 (Q4_K), 0.055 (Q5_K), 0.026
    (Q3_K), 0.021 (Q2_K), 0.057 (Q4_1) and 0.061 (Q5_1) with logits ~1.3 on average (random
    weights), argmax equal wherever the top two are over 0.3 apart (9 to 12 rows); parts out
    of order would be far off.
    (Prefill's int8 copies are the canonical route's, bit for bit: tested above.)"""
    path = write_gguf(tmp_path, False, k_types(main), hidden_size=256, intermediate_size=512,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    llm = _engine(path)
    layouts = {n: m.layout for n, m in llm.runner.model.named_modules()
               if isinstance(m, QuantizedLinear)}  # fmt: skip
    kind = main.lower()
    assert layouts["layers.0.self_attn.qkv_proj"] == f"parts ({kind}+q6_k)"
    assert layouts["layers.1.self_attn.qkv_proj"] == f"{layout} ({kind})"
    assert layouts["layers.0.mlp.gate_up_proj"] == f"{layout} ({kind})"
    assert layouts["layers.0.mlp.down_proj"] == "int8 group 16 (q6_k)"
    exact = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=16, block_size=16,
                swap_space=0, progress=False)  # fmt: skip
    prompts = [[5, 17, 99], [300, 2, 41], [7, 7, 250], [123, 456, 89]]  # 3 rows each
    got = torch.cat([llm.runner.prompt_logits(p) for p in prompts])
    want = torch.cat([exact.runner.prompt_logits(p) for p in prompts])
    assert float((got - want).abs().mean()) < 0.15
    # The same argmax wherever the exact top two are apart (Q5_1 has rows whose top two are
    # under 0.1 apart: ties at this rounding).
    top2 = want.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.3
    assert int(clear.sum()) >= 6
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    tokens = prompts[0]
    out = llm.generate([tokens * 4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].token_ids) == 8


def test_a_file_without_a_bos_id_loads(tmp_path):
    """llama.cpp's converter writes no tokenizer.ggml.bos_token_id for Qwen2.5's tokenizer
    (it has no BOS token); such a file loaded with a TypeError before."""
    path = write_gguf(tmp_path, True, {}, bos=False)
    llm = _engine(path)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 17, 99]], params)[0].token_ids) == 4


@pytest.mark.parametrize("type_name", ["Q4_K", "Q8_0"])
def test_without_vnni_or_amx_prefill_runs_the_kernels(monkeypatch, type_name):
    """Where torch's int8 matmul has neither VNNI nor AMX under it (an AVX2 CPU), no int8
    copy is made and a prefill's 40 rows go through the few-row kernels, 16 at a time: each
    row what a decode step gives."""
    monkeypatch.setattr(linear, "int8_matmul_is_fast", lambda: False)
    layer = QuantizedLinear(from_file(type_name, random_blocks(type_name, 48, 512, seed=8)), None)
    layer.prepare(torch.bfloat16)
    assert layer._int8 is None
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.equal(layer(x), torch.cat([layer(row[None]) for row in x]))
    assert layer._int8 is None


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_decode_arithmetic_runs_any_number_of_rows_as_decode_steps_would(type_name):
    """A speculative verify step's rows (decode_arithmetic) come out bit for bit as one-row
    decode steps would compute them, past the GEMV kernels' 16 rows too; outside it, 17 rows
    take the int8 matmul over requantized codes, which is not that arithmetic, where VNNI or
    AMX makes that matmul fast (else prefill takes the kernels' arithmetic as well)."""
    layer = QuantizedLinear(from_file(type_name, random_blocks(type_name, 64, 512, seed=7)), None)
    layer.prepare(torch.bfloat16)
    x = torch.randn(17, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    one_by_one = torch.cat([layer(row[None]) for row in x])
    with decode_arithmetic():
        assert torch.equal(layer(x), one_by_one)
    assert torch.equal(layer(x), one_by_one) is not int8_matmul_is_fast()
