"""Greedy generation through nanoqwen's public API is token-exact with HF transformers.

Every test builds tiny random Qwen2 checkpoints (float32, CPU) and compares each generated
token of a batch of prompts, run together through the paged engine, with HF ``generate``
run on each prompt alone.

ignore_eos=True (an EOS token may be generated and generation goes on) is compared with HF
generating with EOS off (eos_token_id=None). HF's min_new_tokens is a different thing: it
masks EOS out of the logits, which is nanoqwen's min_tokens, compared separately below.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_model
from tokenizers import Tokenizer

from nanoqwen import LLM, SamplingParams

NEW_TOKENS = 36
TEXT_PROMPTS = [
    "Hello world! How are you today?",
    "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "import torch\nx = torch.zeros(3)\nprint(x.sum())  # The quick brown fox. 你好，世界。",
]
ID_PROMPT_LENGTHS = (1, 15, 17, 100)


@dataclass(frozen=True)
class Shape:
    name: str
    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    block_size: int
    num_hidden_layers: int = 2
    intermediate_size: int = 96


SHAPES = [
    # GQA ratio 1 (plain multi-head), tied embeddings, head_dim == hidden / heads.
    Shape("mha-tied-v509", 509, 64, 4, 4, 16, True, 16),
    # GQA ratio 2, untied, head_dim 32 != hidden / heads (16), odd vocab.
    Shape("gqa2-untied-hd32-v1031", 1031, 64, 4, 2, 32, False, 16),
    # GQA ratio 7 (7 query heads share one KV head), head_dim 16 != 64 / 7.
    Shape("gqa7-untied-hd16-v509", 509, 64, 7, 1, 16, False, 16),
    # GQA ratio 2 with head_dim 64, tied, smaller and larger pages.
    Shape("gqa2-tied-hd64-v1031-bs8", 1031, 128, 2, 1, 64, True, 8),
    Shape("gqa7-tied-hd64-v509-bs32", 509, 96, 7, 1, 64, True, 32),
]


@dataclass
class Checkpoint:
    path: Path
    hf: torch.nn.Module
    shape: Shape
    prompts: list  # as given to nanoqwen: token-id lists and strings
    prompt_ids: list[list[int]]  # what HF is fed (strings encoded by tokenizer.json)


def _make_checkpoint(tmp_path_factory, shape: Shape, seed: int) -> Checkpoint:
    path = tmp_path_factory.mktemp(shape.name)
    hf = write_tiny_model(
        path,
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        tie_word_embeddings=shape.tie_word_embeddings,
        seed=seed,
    )
    assert hf.config.head_dim == shape.head_dim
    gen = torch.Generator().manual_seed(seed + 1)
    id_prompts = [
        torch.randint(0, shape.vocab_size, (n,), generator=gen).tolist() for n in ID_PROMPT_LENGTHS
    ]
    # Different lengths, strings between token lists, the longest not last.
    prompts = [id_prompts[3], TEXT_PROMPTS[0], id_prompts[0], id_prompts[1]]
    prompts += [TEXT_PROMPTS[1], id_prompts[2]]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompt_ids = [tok.encode(p).ids if isinstance(p, str) else p for p in prompts]
    return Checkpoint(path, hf, shape, prompts, prompt_ids)


_HF_CACHE: dict = {}


@torch.inference_mode()
def hf_generate(
    ck: Checkpoint, ids: list[int], max_new_tokens: int, eos=None, **kwargs
) -> list[int]:
    """HF greedy continuation of one prompt (new tokens only). eos=None disables stopping,
    which is what ignore_eos means: an EOS token may be generated, and generation goes on."""
    key = (ck.path, tuple(ids), max_new_tokens, eos, tuple(sorted(kwargs.items())))
    if key not in _HF_CACHE:
        x = torch.tensor([ids])
        out = ck.hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=list(eos) if eos is not None else None,
            pad_token_id=0,
            **kwargs,
        )
        _HF_CACHE[key] = out[0, len(ids) :].tolist()
    return _HF_CACHE[key]


def greedy(max_tokens: int = NEW_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def assert_matches_hf(ck: Checkpoint, outputs, max_new_tokens: int = NEW_TOKENS, **hf_kwargs):
    assert len(outputs) == len(ck.prompts)
    for i, (ids, out) in enumerate(zip(ck.prompt_ids, outputs)):
        assert out.prompt_token_ids == ids, f"prompt {i}: tokenization differs"
        expected = hf_generate(ck, ids, max_new_tokens, **hf_kwargs)
        assert len(expected) == max_new_tokens
        assert out.token_ids == expected, f"prompt {i} (length {len(ids)}) diverges from HF"
        assert out.finish_reason == "length"


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: s.name)
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    return _make_checkpoint(tmp_path_factory, request.param, seed=SHAPES.index(request.param))


@pytest.fixture(scope="module")
def gqa_checkpoint(tmp_path_factory) -> Checkpoint:
    """One GQA checkpoint shared by the scheduling-variant tests."""
    return _make_checkpoint(tmp_path_factory, SHAPES[2], seed=11)


def test_batch_matches_hf(checkpoint):
    llm = LLM(
        str(checkpoint.path),
        block_size=checkpoint.shape.block_size,
        num_kv_blocks=256,
        progress=False,
    )
    outputs = llm.generate(checkpoint.prompts, greedy())
    assert_matches_hf(checkpoint, outputs)
    assert llm.scheduler.num_preemptions == 0
    assert llm.scheduler.blocks.num_free_blocks == 256


def test_preemption_keeps_outputs_identical(gqa_checkpoint):
    # 10 blocks of 16 = 160 tokens: the 100-token prompt plus 36 new tokens fits alone,
    # but the six requests together need about 30 blocks, so decode must preempt.
    llm = LLM(str(gqa_checkpoint.path), block_size=16, num_kv_blocks=10, progress=False)
    outputs = llm.generate(gqa_checkpoint.prompts, greedy())
    assert llm.scheduler.num_preemptions > 0
    assert_matches_hf(gqa_checkpoint, outputs)
    assert llm.scheduler.blocks.num_free_blocks == 10


def test_prefix_cache_hits_keep_outputs_identical(gqa_checkpoint):
    """Prompts that share prefixes with earlier ones (and with each other, in one batch)
    reuse cached blocks and still match HF token for token."""
    ck = gqa_checkpoint
    llm = LLM(str(ck.path), block_size=8, num_kv_blocks=128, progress=False)
    first = llm.generate(ck.prompts, greedy())
    assert_matches_hf(ck, first)
    # Each prompt again, then each prompt plus its own answer's first tokens: the second
    # kind hits blocks registered while the first run decoded.
    longest = max(ck.prompt_ids, key=len)
    extended = [ids + out.token_ids[:20] for ids, out in zip(ck.prompt_ids, first)]
    prompts = ck.prompt_ids + extended + [longest[:k] for k in (9, 33, 64)]
    before = llm.stats()["prefix_cache_hits"]
    outputs = llm.generate(prompts, greedy(max_tokens=12))
    # Every full block but the one holding a prompt's last token is already cached.
    assert llm.stats()["prefix_cache_hits"] - before == sum((len(p) - 1) // 8 * 8 for p in prompts)
    for ids, out in zip(prompts, outputs):
        assert out.token_ids == hf_generate(ck, ids, 12), f"prompt of length {len(ids)}"
    assert llm.scheduler.blocks.num_free_blocks == 128


def test_chunked_prefill_keeps_outputs_identical(gqa_checkpoint):
    # A 24-token budget splits the 100- and 63-token prompts over several steps.
    llm = LLM(
        str(gqa_checkpoint.path),
        block_size=16,
        num_kv_blocks=64,
        max_num_batched_tokens=24,
        progress=False,
    )
    batches = []
    schedule = llm.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        if batch is not None and batch.is_prefill:
            batches.append(list(batch.num_new_tokens))
        return batch

    llm.scheduler.schedule = recording_schedule
    outputs = llm.generate(gqa_checkpoint.prompts, greedy())
    assert_matches_hf(gqa_checkpoint, outputs)
    assert all(sum(b) <= 24 for b in batches)
    assert max(len(p) for p in gqa_checkpoint.prompt_ids) > 24


def test_chunked_prefill_with_preemption_and_few_slots(gqa_checkpoint):
    llm = LLM(
        str(gqa_checkpoint.path),
        block_size=16,
        num_kv_blocks=10,
        max_num_seqs=3,
        max_num_batched_tokens=20,
        progress=False,
    )
    outputs = llm.generate(gqa_checkpoint.prompts, greedy())
    assert llm.scheduler.num_preemptions > 0
    assert_matches_hf(gqa_checkpoint, outputs)


def test_continuous_batching_with_two_slots(gqa_checkpoint):
    llm = LLM(
        str(gqa_checkpoint.path),
        block_size=16,
        num_kv_blocks=64,
        max_num_seqs=2,
        progress=False,
    )
    outputs = llm.generate(gqa_checkpoint.prompts, greedy())
    assert_matches_hf(gqa_checkpoint, outputs)


def test_repetition_penalty_matches_hf(gqa_checkpoint):
    llm = LLM(str(gqa_checkpoint.path), block_size=16, num_kv_blocks=64, progress=False)
    outputs = llm.generate(gqa_checkpoint.prompts, greedy(repetition_penalty=1.3))
    assert_matches_hf(gqa_checkpoint, outputs, repetition_penalty=1.3)
    # The penalty must change something, or this test proves nothing.
    plain = [hf_generate(gqa_checkpoint, ids, NEW_TOKENS) for ids in gqa_checkpoint.prompt_ids]
    assert [o.token_ids for o in outputs] != plain


def _with_eos(src: Path, dst: Path, eos_ids: list[int]) -> Path:
    """A copy of checkpoint src whose generation config (and tokenizer EOS) are eos_ids."""
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["eos_token"] = tok.id_to_token(eos_ids[-1])
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def _pick_eos_pair(outputs: list[list[int]], vocab: int) -> list[int] | None:
    """Two token ids (with tokenizer strings) such that, if both are EOS, one request ends at
    the first, another at the second, and another never meets either."""
    seen = sorted({t for out in outputs for t in out if t < vocab})
    for a in seen:
        for b in seen:
            if a == b:
                continue
            ends = []
            for out in outputs:
                hit = next((t for t in out if t in (a, b)), None)
                pos = out.index(hit) if hit is not None else None
                ends.append((hit, pos))
            if any(pos is not None and pos < 2 for _, pos in ends):
                continue  # want a few tokens before each stop
            hits = [hit for hit, _ in ends]
            if a in hits and b in hits and None in hits:
                return [a, b]
    return None


@pytest.fixture(scope="module")
def eos_checkpoint(gqa_checkpoint, tmp_path_factory):
    """gqa_checkpoint with two EOS ids picked from its greedy outputs, so that some requests
    stop early at either one and others run to max_tokens. Returns (path, EOS ids as HF's
    generation config reads them)."""
    from transformers import GenerationConfig

    ck = gqa_checkpoint
    plain = [hf_generate(ck, ids, NEW_TOKENS) for ids in ck.prompt_ids]
    vocab = Tokenizer.from_file(str(ck.path / "tokenizer.json")).get_vocab_size()
    eos = _pick_eos_pair(plain, vocab)
    assert eos is not None, "no pair of tokens splits these outputs into stop and length"
    path = _with_eos(ck.path, tmp_path_factory.mktemp("eos") / "ckpt", eos)
    hf_eos = tuple(GenerationConfig.from_pretrained(path).eos_token_id)
    assert sorted(hf_eos) == sorted(eos)
    return path, hf_eos


def test_eos_stops_exactly_like_hf(gqa_checkpoint, eos_checkpoint):
    ck, (path, eos) = gqa_checkpoint, eos_checkpoint
    llm = LLM(str(path), block_size=16, num_kv_blocks=64, progress=False)
    assert llm.eos_token_ids == frozenset(eos)
    outputs = llm.generate(ck.prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))

    reasons = []
    for ids, out in zip(ck.prompt_ids, outputs):
        expected = hf_generate(ck, ids, NEW_TOKENS, eos=eos)
        assert out.token_ids == expected
        if expected[-1] in eos:
            assert out.finish_reason == "stop"
        else:
            assert len(out.token_ids) == NEW_TOKENS
            assert out.finish_reason == "length"
        reasons.append(out.finish_reason)
    assert "stop" in reasons and "length" in reasons
    stopped_at = {out.token_ids[-1] for out in outputs if out.finish_reason == "stop"}
    assert stopped_at == set(eos), "each EOS id should end at least one request"

    # The same requests with max_tokens below every stop point all end by length.
    shortest = min(len(o.token_ids) for o in outputs)
    short = llm.generate(ck.prompts, SamplingParams(temperature=0, max_tokens=shortest - 1))
    for out, full in zip(short, outputs):
        assert out.token_ids == full.token_ids[: shortest - 1]
        assert out.finish_reason == "length"


def test_min_tokens_bans_eos_like_hf_min_new_tokens(gqa_checkpoint, eos_checkpoint):
    """min_tokens=max_tokens is HF's min_new_tokens=max_new_tokens: EOS cannot be chosen, so
    the next-best token is taken where ignore_eos would have emitted EOS."""
    ck, (path, eos) = gqa_checkpoint, eos_checkpoint
    llm = LLM(str(path), block_size=16, num_kv_blocks=64, progress=False)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outputs = llm.generate(ck.prompts, params)
    changed = 0
    for ids, out in zip(ck.prompt_ids, outputs):
        expected = hf_generate(ck, ids, NEW_TOKENS, eos=eos, min_new_tokens=NEW_TOKENS)
        assert out.token_ids == expected
        assert out.finish_reason == "length"
        assert not set(out.token_ids) & set(eos)
        changed += out.token_ids != hf_generate(ck, ids, NEW_TOKENS)
    assert changed > 0  # some request would have emitted an EOS id


def test_ignore_eos_generates_through_eos(gqa_checkpoint, eos_checkpoint):
    ck, (path, eos) = gqa_checkpoint, eos_checkpoint
    llm = LLM(str(path), block_size=16, num_kv_blocks=64, progress=False)
    outputs = llm.generate(ck.prompts, greedy())
    assert_matches_hf(ck, outputs)  # HF with EOS off
    assert any(set(o.token_ids[:-1]) & set(eos) for o in outputs)
