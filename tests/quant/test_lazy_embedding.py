"""A GGUF model's CPU embedding kept as the file's blocks (load_gguf._embedding): loaded
without decoding them, it looks up every token as the embedding decoded at load did, the tied
lm_head built from it is the same layer, and greedy tokens are unchanged; types gguf_blocks
does not read exactly (float ones, Q4_0) and GPUs keep the decoded weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_gguf import write_gguf

from nanoqwen import LLM, SamplingParams
from nanoqwen.model import load_gguf
from nanoqwen.quant.format import QuantizedWeight
from nanoqwen.quant.gguf_blocks import EXACT_TYPES
from nanoqwen.quant.gguf_rows import GGUFRows
from nanoqwen.quant.linear import QuantizedLinear
from nanoqwen.weights.gguf import GGUFCheckpoint

gguf = pytest.importorskip("gguf")
EMBEDDING = load_gguf.EMBEDDING
CPU = torch.device("cpu")


def _eager(t, device) -> QuantizedWeight:
    """The embedding decoded in full at load (every row as int8), the reference for the lazy one."""
    value = load_gguf._canonical(t)
    return value if isinstance(value, QuantizedWeight) else load_gguf.quantize_int8(value, 32)


def _engine(path, dtype: str, **kw) -> LLM:
    return LLM(str(path), device="cpu", dtype=dtype, num_kv_blocks=16, block_size=16,
               swap_space=0, progress=False, **kw)  # fmt: skip


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    bits = (t.contiguous().view(torch.uint8) for t in (a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*bits)


def _same_lm_head(a: QuantizedLinear, b: QuantizedLinear) -> bool:
    tensors = [(a._decode, b._decode), (a._int8 or (), b._int8 or ())]
    if isinstance(a.weight, QuantizedWeight) or isinstance(b.weight, QuantizedWeight):
        tensors.append((vars(a.weight).values(), vars(b.weight).values()))
    pairs = [(x, y) for xs, ys in tensors for x, y in zip(xs, ys, strict=True)]
    return a.kind == b.kind and all(
        _same(x, y) if isinstance(x, torch.Tensor) or x is None else x == y for x, y in pairs
    )


CONFIGS = [("bfloat16", False), ("bfloat16", True), ("float32", True)]


@pytest.mark.parametrize(("dtype", "tied"), CONFIGS)
@pytest.mark.parametrize("type_name", [*EXACT_TYPES, "Q4_0", "F16"])
def test_model_embeds_and_generates_as_before(tmp_path, monkeypatch, type_name, dtype, tied):
    path = write_gguf(tmp_path, tied, {EMBEDDING: type_name}, hidden_size=256)
    decoded: list[str] = []
    canonical = load_gguf._canonical
    monkeypatch.setattr(load_gguf, "_canonical", lambda t: decoded.append(t.name) or canonical(t))
    new = _engine(path, dtype)
    lazy = type_name in EXACT_TYPES
    emb = new.runner.model.embed_tokens
    assert isinstance(emb.weight, GGUFRows if lazy else QuantizedWeight)
    assert (EMBEDDING in decoded) == (not lazy)  # nothing decoded at load for the lazy rows

    monkeypatch.setattr(load_gguf, "_embedding", _eager)
    old = _engine(path, dtype)
    before = old.runner.model.embed_tokens
    assert (emb.shape, emb.device, emb.dtype) == (before.shape, before.device, before.dtype)
    every = torch.arange(emb.shape[0])
    assert _same(emb[every], before[every])
    assert _same_lm_head(new.runner.model.lm_head, old.runner.model.lm_head)

    prompts = [[5, 17, 99, 3, 250, 41, 8, 8, 120, 7], [300, 12]]  # prefill and decode shapes
    params = SamplingParams(temperature=0, max_tokens=12)
    got = [o.token_ids for o in new.generate(prompts, params)]
    assert got == [o.token_ids for o in old.generate(prompts, params)]


def test_gpus_keep_the_decoded_weight(tmp_path):
    """On a GPU the loader decodes at load as before (no GPU needed: the move comes later)."""
    path = write_gguf(tmp_path, False, {})
    t = next(t for t in GGUFCheckpoint(path).tensors() if t.name == EMBEDDING)
    assert isinstance(load_gguf._embedding(t, CPU), GGUFRows)
    on_gpu = load_gguf._embedding(t, torch.device("cuda", 0))
    want = _eager(t, None)
    assert isinstance(on_gpu, QuantizedWeight)
    assert _same(on_gpu.q, want.q) and _same(on_gpu.scale, want.scale)


def test_the_rows_map_only_their_own_bytes(tmp_path):
    """The blocks kept past the load: a mapping of the embedding's bytes alone (a view of the
    checkpoint's would keep every page the load read resident)."""
    path = write_gguf(tmp_path, False, {EMBEDDING: "Q8_0"})
    t = next(t for t in GGUFCheckpoint(path).tensors() if t.name == EMBEDDING)
    mine = t.own_mapping()
    assert type(mine) is np.ndarray and not mine.flags.writeable
    assert np.array_equal(mine, t.data) and not np.shares_memory(mine, t.data)
    mapping = mine.base
    assert isinstance(mapping, np.memmap) and mapping.offset == t.offset
    assert mapping.nbytes == t.data.nbytes


@pytest.mark.real_model
def test_default_model_embeds_and_generates_as_before(gguf_path, monkeypatch):
    new = _engine(gguf_path, "bfloat16")
    emb = new.runner.model.embed_tokens
    assert isinstance(emb.weight, GGUFRows)
    monkeypatch.setattr(load_gguf, "_embedding", _eager)
    old = _engine(gguf_path, "bfloat16")
    every = torch.arange(emb.shape[0])
    assert _same(emb[every], old.runner.model.embed_tokens[every])
    params = SamplingParams(temperature=0, max_tokens=8)
    text = ["def reverse(s):"]
    assert new.generate(text, params)[0].token_ids == old.generate(text, params)[0].token_ids
