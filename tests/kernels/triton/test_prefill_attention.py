"""The Triton paged prefill (the triton backend's prefill: rope_and_store, then the kernel of
kernels/triton/prefill_attention.py) against the torch reference backend and a float64 reference.

On CPU the kernels run in Triton's interpreter (tests/conftest.py), in float32 and float16,
with small tiles so that a few dozen tokens already span several query and key tiles;
tests/gpu runs them compiled, in bfloat16, at the real tile sizes.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import paged_prefill_step

from nanoqwen.attention.metadata import AttentionMetadata
from nanoqwen.attention.rotary import RotaryEmbedding
from nanoqwen.attention.torch_backend import TorchAttention, paged_attention

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter"
)
import nanoqwen.kernels.triton.prefill_attention as pa  # noqa: E402
from nanoqwen.attention.triton_backend import TritonAttention  # noqa: E402

# (tokens already cached, new tokens) per sequence: a fresh prompt of one token, a fresh
# prompt over several tiles, chunks over cached context that is not tile- or block-aligned,
# and a chunk of three over a long context.
RUNS = [(0, 1), (0, 37), (30, 5), (45, 40), (100, 3)]


def _run_both(qkv, k_cache, v_cache, meta, head_dim, dtype_ref=None):
    """(triton output, its caches), (torch backend output, its caches); the reference runs
    in dtype_ref when given (upcast inputs)."""
    rotary = RotaryEmbedding(head_dim, 1024, 1e6, "cpu")
    scale = head_dim**-0.5
    cast = (lambda t: t.to(dtype_ref)) if dtype_ref else (lambda t: t.clone())
    k_ref, v_ref = cast(k_cache), cast(v_cache)
    ref = TorchAttention(rotary, scale).forward(cast(qkv), k_ref, v_ref, meta)
    out = TritonAttention(rotary, scale, use_flash_attn=False).forward(qkv, k_cache, v_cache, meta)
    return (out, k_cache, v_cache), (ref, k_ref, v_ref)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page"),
    [(14, 2, 64, 16), (8, 2, 128, 32), (7, 1, 64, 64), (4, 4, 128, 256)],
    ids=["0.5B-heads-page16", "group4-dim128-page32", "group7-page64", "no-gqa-page256"],
)
def test_matches_torch_backend_and_writes_the_new_kv(heads, kv_heads, head_dim, page, monkeypatch):
    qkv, k_cache, v_cache, meta = paged_prefill_step(
        RUNS, heads, kv_heads, head_dim, page, torch.float32
    )
    untouched = k_cache.clone()
    # Several query and key tiles per sequence; a key tile spans two blocks of 16 (the per-key
    # block lookup) or lies inside one larger block (one lookup per tile).
    monkeypatch.setitem(pa.CONFIGS, head_dim, (16, 32, 4, 1))
    (out, k, v), (ref, k_ref, v_ref) = _run_both(qkv, k_cache, v_cache, meta, head_dim)
    assert out.shape == (qkv.shape[0], heads, head_dim)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # The rotated keys and the values landed in their slots; every other slot kept its value.
    torch.testing.assert_close(k, k_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(v, v_ref)
    written = torch.zeros(k.numel() // (kv_heads * head_dim), dtype=torch.bool)
    written[meta.slot_mapping] = True
    flat = k.view(-1, kv_heads, head_dim)
    assert torch.equal(flat[~written], untouched.view(-1, kv_heads, head_dim)[~written])
    assert not torch.equal(flat[written], untouched.view(-1, kv_heads, head_dim)[written])


@pytest.mark.parametrize("config", [None, (32, 16, 4, 1), (16, 64, 4, 1)],
                         ids=["default-tiles", "32x16", "16x64"])  # fmt: skip
def test_float16_is_float64_attention_and_rounds_keys_like_the_torch_path(config, monkeypatch):
    """The fp16 output is within fp16 resolution of attention computed in float64, and the
    cached keys are bit-identical to the torch path's (RoPE rounds as HF does)."""
    heads, kv_heads, head_dim = 6, 2, 64
    qkv, k_cache, v_cache, meta = paged_prefill_step(RUNS[1:4], heads, kv_heads, head_dim, 16,
                                                torch.float16, seed=1)  # fmt: skip
    rotary = RotaryEmbedding(head_dim, 1024, 1e6, "cpu")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    TorchAttention(rotary, 0.125).forward(qkv.clone(), k_ref, v_ref, meta)
    if config:
        monkeypatch.setitem(pa.CONFIGS, head_dim, config)
    backend = TritonAttention(rotary, 0.125, use_flash_attn=False)
    out = backend.forward(qkv, k_cache, v_cache, meta)  # rotates qkv's q columns in place
    assert out.dtype == torch.float16
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    # float64 attention over the same fp16 rotated q and cached K/V the kernel reads.
    q64 = qkv[:, : heads * head_dim].double().view(-1, heads, head_dim)
    ref = paged_attention(q64, k_ref.double(), v_ref.double(), meta, 0.125)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=4e-3)


def test_chunked_prefill_equals_one_pass():
    """A prompt prefilled in three chunks (each attending to the cached chunks before it)
    gives the outputs and the cache of one pass over the whole prompt."""
    heads, kv_heads, head_dim, page = 4, 2, 64, 16
    n = 50
    whole, k_whole, v_whole, meta = paged_prefill_step([(0, n)], heads, kv_heads, head_dim, page,
                                                  torch.float32, seed=2)  # fmt: skip
    k_chunks, v_chunks = k_whole.clone(), v_whole.clone()
    rotary = RotaryEmbedding(head_dim, 1024, 1e6, "cpu")
    backend = TritonAttention(rotary, head_dim**-0.5, use_flash_attn=False)
    expected = backend.forward(whole.clone(), k_whole, v_whole, meta)
    outs = []
    for start, end in [(0, 17), (17, 18), (18, n)]:
        chunk = AttentionMetadata(
            is_prefill=True,
            positions=meta.positions[start:end],
            slot_mapping=meta.slot_mapping[start:end],
            context_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=meta.block_tables,
            cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
            max_seqlen_q=end - start,
            max_seqlen_k=end,
            cu_seqlens_k=torch.tensor([0, end], dtype=torch.int32),
        )
        outs.append(backend.forward(whole[start:end].clone(), k_chunks, v_chunks, chunk))
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_chunks, k_whole) and torch.equal(v_chunks, v_whole)


def test_a_prefill_graph_bucket_computes_the_chunk_as_alone():
    """A prefill graph (runtime/prefill_graph.py) runs a chunk as the first sequence of a
    bucket of rows, a padding sequence after it and max_seqlen_q the bucket's size: the
    chunk's rows and cache entries must be what the chunk alone gives."""
    heads, kv_heads, head_dim, page = 4, 2, 64, 16
    # 21 new tokens over 30 cached, then 11 padding tokens: a bucket of 32 rows.
    qkv, k_cache, v_cache, meta = paged_prefill_step([(30, 21), (0, 11)], heads, kv_heads,
                                                head_dim, page, torch.float32, seed=3)  # fmt: skip
    meta.max_seqlen_q, meta.padded = 32, True
    alone = AttentionMetadata(
        is_prefill=True,
        positions=meta.positions[:21],
        slot_mapping=meta.slot_mapping[:21],
        context_lens=meta.context_lens[:1],
        block_tables=meta.block_tables[:1],
        cu_seqlens_q=meta.cu_seqlens_q[:2],
        max_seqlen_q=21,
        max_seqlen_k=51,
        cu_seqlens_k=meta.cu_seqlens_k[:2],
    )
    rotary = RotaryEmbedding(head_dim, 1024, 1e6, "cpu")
    backend = TritonAttention(rotary, head_dim**-0.5, use_flash_attn=False)
    k_alone, v_alone = k_cache.clone(), v_cache.clone()
    expected = backend.forward(qkv[:21].clone(), k_alone, v_alone, alone)
    padded = backend.forward(qkv.clone(), k_cache, v_cache, meta)
    torch.testing.assert_close(padded[:21], expected, rtol=1e-6, atol=1e-6)
    own = meta.block_tables[0, :4].long()
    assert torch.equal(k_cache[own], k_alone[own]) and torch.equal(v_cache[own], v_alone[own])


def test_a_mixed_step_bucket_with_sequences_of_no_rows_matches_the_reference():
    """A mixed step's graph (runtime/prefill_graph.py): two decoding sequences, a prompt
    chunk, the padding sequence, and sequences of no rows up to the bucket's capacity, with
    max_seqlen_q the bucket's size. Every row is what the torch backend computes."""
    heads, kv_heads, head_dim, page = 4, 2, 64, 16
    runs = [(40, 1), (12, 1), (30, 21), (0, 9), (0, 0), (0, 0)]
    qkv, k_cache, v_cache, meta = paged_prefill_step(runs, heads, kv_heads, head_dim, page,
                                                     torch.float32, seed=5)  # fmt: skip
    meta.max_seqlen_q, meta.padded = 32, True
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 23, 32, 32, 32]
    (out, k, v), (ref, k_ref, v_ref) = _run_both(qkv, k_cache, v_cache, meta, head_dim)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.parametrize("splits", [1, 3, 16], ids=["one-split", "3-splits", "16-splits"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page", "runs"),
    [
        # Decoding rows (one new token) beside prompt chunks over long and short contexts,
        # a fresh prompt and sequences of no rows, as a mixed step's graph lays them out.
        (14, 2, 64, 16, [(130, 1), (0, 37), (200, 45), (5, 1), (0, 0), (0, 0)]),
        # 7B's group of 7 (padded to 16 rows), blocks of 32.
        (28, 4, 128, 32, [(90, 1), (150, 20), (31, 1)]),
        # No GQA: a decoding row's group is its one head.
        (4, 4, 64, 16, [(70, 1), (60, 33)]),
    ],
    ids=["0.5B-mixed", "7B-group7", "mha"],
)
def test_split_keys_match_the_torch_backend(heads, kv_heads, head_dim, page, runs, splits,
                                            monkeypatch):  # fmt: skip
    """Every split count, with slices of 32 keys: tiles whose keys one slice holds (written
    directly), tiles over several (merged), slices a row sees none of (its own position is
    before them), decoding rows packed by KV group, and splits past a short context."""
    qkv, k_cache, v_cache, meta = paged_prefill_step(runs, heads, kv_heads, head_dim, page,
                                                     torch.float32, seed=6)  # fmt: skip
    monkeypatch.setitem(pa.CONFIGS, head_dim, (16, 16, 4, 1))
    monkeypatch.setattr(pa, "MIN_SPLIT_KEYS", 32)
    monkeypatch.setattr(pa, "num_splits_for", lambda tiles, heads, keys: splits)
    (out, k, v), (ref, k_ref, v_ref) = _run_both(qkv, k_cache, v_cache, meta, head_dim)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, v_ref)


def test_split_counts_fill_the_gpu_only_over_long_contexts():
    # A 7B mixed step's bucket of 256 rows (two tiles of 128, 28 heads) over a 32K context:
    # 4 splits make 224 programs for the chunk; short contexts, or tiles enough, run whole.
    assert pa.num_splits_for(2, 28, 32768) == 4
    assert pa.num_splits_for(1, 14, 32768) == 16
    assert pa.num_splits_for(1, 14, 1024) == 2
    assert pa.num_splits_for(2, 28, 512) == 1
    assert pa.num_splits_for(64, 28, 32768) == 1


@pytest.mark.parametrize("page", [16, 64], ids=["key-by-key", "one-copy-a-tile"])
@pytest.mark.parametrize("splits", [1, 3], ids=["one-split", "3-splits"])
def test_slots_past_the_context_are_never_trusted(page, splits, monkeypatch):
    """A tile inside one block is copied whole, slots past the context included: NaN there
    (a slot never written, or left by an earlier request) must not reach the output."""
    runs = [(0, 37), (30, 5), (45, 40), (100, 1)]
    qkv, k_cache, v_cache, meta = paged_prefill_step(runs, 14, 2, 64, page, torch.float32)
    monkeypatch.setitem(pa.CONFIGS, 64, (16, 32, 4, 1))
    monkeypatch.setattr(pa, "MIN_SPLIT_KEYS", 32)
    monkeypatch.setattr(pa, "num_splits_for", lambda tiles, heads, keys: splits)
    live = torch.zeros(k_cache.shape[0] * page, dtype=torch.bool)
    for row, (cached, new) in enumerate(runs):
        at = torch.arange(cached + new)
        live[meta.block_tables[row, at // page].long() * page + at % page] = True
    _, (ref, _, _) = _run_both(qkv.clone(), k_cache.clone(), v_cache.clone(), meta, 64)
    k_cache.view(-1, 2, 64)[~live] = float("nan")
    v_cache.view(-1, 2, 64)[~live] = float("nan")
    (out, _, _), _ = _run_both(qkv, k_cache, v_cache, meta, 64)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
