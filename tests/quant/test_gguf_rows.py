"""GGUFRows (quant/gguf_rows.py), the CPU embedding's file blocks decoded a lookup at a time,
against the whole tensor decoded at load (what the embedding held before): the same codes and
scales for every row, and so the same embedding output bit for bit in every activation dtype,
for each block type gguf_blocks reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_gguf import K_QUANTS, random_blocks

from nanoqwen.quant.format import QuantizedWeight
from nanoqwen.quant.gguf_blocks import EXACT_TYPES, from_gguf_blocks
from nanoqwen.quant.gguf_rows import GGUFRows
from nanoqwen.quant.linear import QuantizedEmbedding

gguf = pytest.importorskip("gguf")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _quantized(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """A quantizer's blocks (gguf.quants has none for the K-quants: random blocks there)."""
    if type_name in K_QUANTS:
        return random_blocks(type_name, n, k, seed)
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])


def _cases() -> list[tuple[str, np.ndarray]]:
    """Every type, as a quantizer writes it and as random blocks; an odd number of blocks a
    row where the type allows (an embedding 896 wide is 28 Q5_0 blocks, 3.5 K-quant ones)."""
    cases = []
    for i, t in enumerate(EXACT_TYPES):
        k = 256 * 3 if t in K_QUANTS else 32 * 7
        cases += [(t, _quantized(t, 48, k, seed=i)), (t, random_blocks(t, 40, k, seed=10 + i))]
    return cases


def _ids(n: int) -> torch.Tensor:
    """Every row once in shuffled order, then repeats and negative ids (from the end)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(n))
    return torch.cat([perm, torch.tensor([0, 0, n - 1, 3, -1, -n, 5, 5])])


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor's bytes: equality that tells -0.0 from 0.0 and compares NaNs."""
    return None if t is None else t.contiguous().view(torch.uint8)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _same_weight(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    return (
        (a.bits, a.group_size) == (b.bits, b.group_size)
        and _same(a.q, b.q)
        and _same(a.scale, b.scale)
        and _same(a.offset, b.offset)
    )


@pytest.mark.parametrize(("type_name", "raw"), _cases())
def test_rows_equal_the_whole_tensor_decoded(type_name, raw):
    full = from_gguf_blocks(type_name, raw)
    lazy = GGUFRows(type_name, raw)
    assert lazy.shape == full.shape and lazy.device == torch.device("cpu")
    assert _same_weight(lazy.decode(), full)
    ids = _ids(full.shape[0])
    assert _same_weight(lazy.rows(ids), full.rows(ids))
    for dtype in DTYPES:
        old, new = QuantizedEmbedding(full, dtype), QuantizedEmbedding(lazy, dtype)
        assert new.shape == old.shape and new.device == old.device
        assert _same(new[ids], old[ids]), dtype
        one = torch.tensor([full.shape[0] // 2])  # a decode step's lookup
        assert _same(new[one], old[one]), dtype


@pytest.mark.parametrize("type_name", EXACT_TYPES)
def test_edge_lookups_behave_as_before(type_name):
    raw = _quantized(type_name, 16, 256, seed=0)
    old = QuantizedEmbedding(from_gguf_blocks(type_name, raw), torch.bfloat16)
    new = QuantizedEmbedding(GGUFRows(type_name, raw), torch.bfloat16)
    for ids in (torch.empty(0, dtype=torch.int64), torch.tensor([7], dtype=torch.int32)):
        assert _same(new[ids], old[ids])
    two_d, past_the_end = torch.tensor([[1, 2]]), torch.tensor([16])
    for bad, error in ((two_d, ValueError), (past_the_end, IndexError)):
        for emb in (old, new):
            with pytest.raises(error):
                emb[bad]


def test_rows_stay_on_the_cpu_and_decode_to_move():
    raw = _quantized("Q5_0", 8, 64, seed=0)
    lazy = GGUFRows("Q5_0", raw)
    assert lazy.to("cpu") is lazy and lazy.to(torch.device("cpu")) is lazy
    moved = lazy.to("meta")  # where a GPU would take the decoded weight
    assert isinstance(moved, QuantizedWeight) and moved.q.device.type == "meta"
    assert moved.shape == lazy.shape


def test_malformed_blocks_are_refused():
    with pytest.raises(ValueError, match="allowed"):
        GGUFRows("IQ4_NL", np.zeros((2, 18), dtype=np.uint8))
    with pytest.raises(ValueError, match="multiple of 22"):
        GGUFRows("Q5_0", np.zeros((2, 23), dtype=np.uint8))
