"""The decode graphs' static inputs before any step fills them: what every capture's
warm-up runs on (host-side layout; runs without a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from nanoqwen.runtime.cuda_graph import CUDAGraphRunner, capture_sizes
from nanoqwen.runtime.kv.cache import KVCache

CFG = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=8)


def test_every_captured_batch_is_all_padding_rows_in_a_full_launch_order():
    """Each warm-up must run every row (the decode kernel runs row order[i] as its i-th; an
    order of zeros left the other rows' outputs as stale memory) and keep every row on the
    KV scratch block and the sampler's scratch slot."""
    kv = KVCache.allocate(CFG, 12, 16, torch.float32, "cpu")
    graphs = CUDAGraphRunner(40, kv, sampler_scratch=40)
    graphs._allocate(torch.device("cpu"), 256, [(128, 2), (256, 1)])
    assert graphs.sizes == capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    scratch = kv.scratch_block
    for bs in graphs.sizes:
        for variant in (0, 1):
            meta = graphs._static_meta(bs, variant, cascade=True)
            assert sorted(meta.decode_order.tolist()) == list(range(bs))
            assert meta.context_lens.tolist() == [1] * bs
            assert meta.positions.tolist() == [0] * bs
            assert meta.slot_mapping.tolist() == [scratch * 16] * bs
            assert set(meta.block_tables.flatten().tolist()) == {scratch}
            assert set(meta.suffix_tables.flatten().tolist()) == {scratch}
            assert meta.block_tables.shape == (bs, 8 if variant == 0 else 16)
    assert graphs.ids.tolist() == [0] * 40
    assert graphs.sampler_slots.tolist() == [40] * 40


def test_a_step_copies_the_start_of_the_buffer_that_holds_all_its_graph_reads():
    """Each step copies (and under tensor parallelism broadcasts) only inputs(key): every
    view the graph of key reads must end inside it, and it must stay far below the whole
    buffer for small batches (the whole was 262 KB a step at batch 1 with 16 rows of 2,048
    blocks)."""
    kv = KVCache.allocate(CFG, 12, 16, torch.float32, "cpu")
    graphs = CUDAGraphRunner(16, kv, sampler_scratch=16)
    graphs._allocate(torch.device("cpu"), 32768, [(4096, 4), (32768, 1)])
    base, item = graphs.buffer.dev.data_ptr(), graphs.buffer.dev.element_size()
    for bs in graphs.sizes:
        for variant in (0, 1):
            for cascade in (False, True):
                key = (bs, variant, False, cascade)
                end = base + graphs.inputs(key).numel() * item
                meta = graphs._static_meta(bs, variant, cascade)
                views = [graphs.ids[:bs], graphs.sampler_slots[:bs]]
                views += [v for v in vars(meta).values() if isinstance(v, torch.Tensor)]
                for v in views:
                    if v is meta.cu_seqlens_q:  # a buffer of its own, never copied
                        continue
                    extent = 1 + sum((d - 1) * st for d, st in zip(v.shape, v.stride()))
                    last = v.data_ptr() + extent * v.element_size()
                    assert base <= v.data_ptr() and last <= end, (key, v.shape)
    whole = graphs.buffer.dev.numel() * item
    assert whole > 250_000
    assert graphs.inputs((1, 0, False, False)).numel() * item < 10_000
