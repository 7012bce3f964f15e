"""Shared fixtures: tiny random Qwen2 checkpoints written the way HF writes real ones."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def _run_triton_kernels_on_cpu() -> None:
    """Without a GPU, Triton's interpreter runs the kernels on CPU tensors, so their logic is
    tested in CI too (in float32/float16: the interpreter has no bfloat16). It must be chosen
    before any kernel module is imported."""
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = interpreter._patch_lang_tensor

    def patch_with_scalar_index(tensor, scope):
        patch(tensor, scope)
        # Scalars are 1-element arrays in the interpreter, which numpy >= 2.3 no longer
        # turns into an int for a Python range() (Triton 3.6; upstream squeezes them now).
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_with_scalar_index


if not torch.cuda.is_available():
    _run_triton_kernels_on_cpu()

QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today?",
    "import torch\nx = torch.zeros(3)\nprint(x.sum())",
    "你好，世界。今天天气很好。",
    "system user assistant You are a helpful assistant.",
]


def build_tokenizer(vocab_size: int = 400):
    """A byte-level BPE like Qwen's, trained on a few lines: real merges, real decoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    return tok


def write_tiny_model(
    path: Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 96,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    max_position_embeddings: int = 2048,
    chat_template: str | None = QWEN_CHAT_TEMPLATE,
    eos: tuple[str, ...] = ("<|im_end|>",),
):
    """Writes an HF-format tiny Qwen2 checkpoint + tokenizer to path; returns the HF model.

    initializer_range 0.2 (10x HF's default) gives peaked, varied greedy outputs instead of
    the near-uniform logits of tiny default-init models, so ties do not decide tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer(min(400, vocab_size))
    eos_ids = [tok.token_to_id(t) for t in eos]
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim or hidden_size // num_attention_heads,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.2,
        rope_theta=10000.0,
        eos_token_id=eos_ids[0],
        bos_token_id=tok.token_to_id("<|endoftext|>"),
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    tok_cfg = {"eos_token": eos[0], "pad_token": "<|endoftext|>", "bos_token": None}
    if chat_template is not None:
        tok_cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """(checkpoint dir, HF model) of the default tiny config, shared by a whole test run."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    return path, write_tiny_model(path)


def readme_signature(name: str) -> dict[str, object]:
    """The keyword defaults of `name(...)` as README.md's API section spells them."""
    text = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    match = re.search(rf"`{name}\(([^`]*)\)`", text)
    assert match, f"README documents no {name}(...) signature"
    call = ast.parse(f"f({match.group(1)})").body[0].value
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}


def pytest_collection_modifyitems(config, items):
    """Everything under tests/gpu/ is marked gpu and skipped on machines without CUDA."""
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.path.parts:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


# ---- the real checkpoint (tests marked real_model) -------------------------------------------
REAL_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
REAL_MODEL_REPORT: list[str] = []  # lines printed at the end of the run by real-model tests


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The default checkpoint (weights/Qwen2.5-Coder-0.5B-Instruct). Skips the test when it is
    not built, or fails it when NANOQWEN_REQUIRE_REAL_MODEL=1 (as CI sets)."""
    import os

    from nanoqwen.weights.hub import default_model_dir

    path = default_model_dir()
    missing = [name for name in REAL_MODEL_FILES if not (path / name).is_file()]
    if missing:
        reason = (
            f"the real checkpoint is not built at {path} (missing {', '.join(missing)}): "
            "run `python tools/make_qwen_coder.py` to build it"
        )
        if os.environ.get("NANOQWEN_REQUIRE_REAL_MODEL") == "1":
            pytest.fail(f"NANOQWEN_REQUIRE_REAL_MODEL=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    return path


@pytest.fixture(scope="module")
def gguf_path(real_model_dir):
    """The GGUF the default checkpoint is built from (tools/make_qwen_coder.py keeps it)."""
    path = real_model_dir.parent / ".cache" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing: run `python tools/make_qwen_coder.py`")
    return path


def pytest_terminal_summary(terminalreporter):
    if REAL_MODEL_REPORT:
        terminalreporter.section("real-model fidelity")
        for line in REAL_MODEL_REPORT:
            terminalreporter.write_line(line)


def shuffled_paged_cache(lengths, page, kv_heads, head_dim, dtype, gen):
    """Block tables over a shuffled pool for sequences of these lengths, and random K/V caches
    of the pool ([blocks, page, kv_heads, head_dim], one spare block)."""
    blocks = [-(-n // page) for n in lengths]
    perm = torch.randperm(sum(blocks) + 1, generator=gen).tolist()
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    for i, b in enumerate(blocks):
        tables[i, :b] = torch.tensor(perm[:b])
        perm = perm[b:]
    shape = (sum(blocks) + 1, page, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    return tables, k_cache, v_cache


def paged_prefill_step(runs, heads, kv_heads, head_dim, page, dtype, seed=0):
    """A prefill step over shuffled blocks whose cached context is random K/V; returns qkv,
    the caches and the metadata."""
    from nanoqwen.attention.metadata import AttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    lengths = [c + n for c, n in runs]
    tables, k_cache, v_cache = shuffled_paged_cache(lengths, page, kv_heads, head_dim, dtype, gen)
    positions = [p for c, n in runs for p in range(c, c + n)]
    seq_of = [i for i, (_, n) in enumerate(runs) for _ in range(n)]
    slots = [int(tables[i, p // page]) * page + p % page for i, p in zip(seq_of, positions)]
    cu_q, cu_k = [0], [0]
    for (_, n), total in zip(runs, lengths):
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + total)
    width = (heads + 2 * kv_heads) * head_dim
    # Keys with a large norm make the softmax peaked, so that a wrong mask or a wrong key
    # shows up in the output instead of averaging away.
    qkv = (2 * torch.randn(len(positions), width, generator=gen)).to(dtype)
    meta = AttentionMetadata(
        is_prefill=True,
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        context_lens=torch.tensor(lengths, dtype=torch.int32),
        block_tables=tables,
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
        max_seqlen_q=max(n for _, n in runs),
        max_seqlen_k=max(lengths),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
    )
    return qkv, k_cache, v_cache, meta


# ---- attention setups of the GPU tests (tests/gpu) -------------------------------------------
# (backend, block size, whether flash-attn imports): the triton backend also runs on a GPU
# without flash-attn (its own kernels only), at any block size.
GPU_SETUPS = {
    "flash-attn": ("flash-attn", 256, True),
    "triton": ("triton", 256, True),
    "triton-no-flash-attn": ("triton", 256, False),
    "triton-block16-no-flash-attn": ("triton", 16, False),
}


@pytest.fixture(params=list(GPU_SETUPS))
def backend(request, monkeypatch) -> tuple[str, int, bool]:
    """One of GPU_SETUPS, with `import flash_attn` made to fail where it says so."""
    name, block, flash = GPU_SETUPS[request.param]
    if flash:
        pytest.importorskip("flash_attn")
    else:
        monkeypatch.setitem(sys.modules, "flash_attn", None)
    return name, block, flash


def run_without_a_compiler(script: str, cache: Path) -> subprocess.CompletedProcess:
    """script in a fresh interpreter whose C builds fail (CC=false), with an empty kernel
    cache: what a machine without a C compiler sees."""
    env = {**os.environ, "CC": "false", "NANOQWEN_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )


def launch_two_steps_without_host_sync(llm, first) -> None:
    """Launches the scheduled batch `first` and the step scheduled after it (a token still in
    flight) with CUDA's sync debug mode raising on any host sync, then waits for both."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        one = llm._launch(first)
        two = llm._launch(llm.scheduler.schedule())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    one.result(), two.result()
