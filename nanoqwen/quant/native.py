"""The C kernel q5_gemv.c: GGUF Q5_0 weights kept as they are in the file (5.5 bits a weight,
against 8 for torch's per-channel int8 kernel) for the few-row CPU matmuls of decode.

It is compiled at first use with the system C compiler (-march=native, OpenMP) into a cache
directory and called through ctypes; where there is no compiler or the CPU lacks AVX512-VNNI
the build fails once and `q5_kernel()` returns None, and the layers keep torch's kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch

from nanoqwen.quant.format import QuantizedWeight

SOURCE = Path(__file__).with_name("q5_gemv.c")
MAX_ROWS = 8  # MAX_ROWS in q5_gemv.c
_c_int64, _ptr = ctypes.c_int64, ctypes.c_void_p


def cache_dir() -> Path:
    root = os.environ.get("NANOQWEN_CACHE") or os.environ.get("XDG_CACHE_HOME")
    return Path(root or Path.home() / ".cache") / "nanoqwen"


def _build(source: Path, target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed: test processes may build at the same time.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(source), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise OSError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
    os.replace(tmp, target)


@cache
def q5_kernel() -> ctypes.CDLL | None:
    """The loaded library, or None (with one note on stderr) when it cannot be built here.
    NANOQWEN_NATIVE=0 turns it off."""
    if os.environ.get("NANOQWEN_NATIVE", "1") == "0":
        return None
    code = SOURCE.read_bytes()
    key = hashlib.sha256(code + torch.__version__.encode()).hexdigest()[:16]
    target = cache_dir() / f"q5_gemv-{key}.so"
    try:
        if not target.is_file():
            _build(SOURCE, target)
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        print(
            f"[nanoqwen] Q5_0 CPU kernel unavailable, using torch's int8 kernel: {e}",
            file=sys.stderr,
        )
        return None
    lib.q5_gemv.restype = ctypes.c_int
    # x, is_bf16, M, K, qs, qh, d, N, y, threads
    lib.q5_gemv.argtypes = [_ptr, ctypes.c_int, _c_int64, _c_int64, *[_ptr] * 3, _c_int64]
    lib.q5_gemv.argtypes += [_ptr, ctypes.c_int]
    return lib


def is_q5_0(w: QuantizedWeight) -> bool:
    """Whether w is a Q5_0 tensor's exact canonical form: int8 codes -16..15 in groups of 32,
    one float16-representable scale each, no offset."""
    if w.bits != 8 or w.group_size != 32 or w.offset is not None or w.q.device.type != "cpu":
        return False
    if int(w.q.min()) < -16 or int(w.q.max()) > 15:
        return False
    return bool(torch.equal(w.scale.half().float(), w.scale))


def pack_q5_0(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qs uint8 [N, K/32, 16], qh int32 [N, K/32], d float16 [N, K/32]): q5_gemv.c's layout."""
    n, k = w.shape
    codes = (w.q.to(torch.int16) + 16).view(n, k // 32, 32)
    low = (codes & 15).to(torch.uint8)
    qs = low[..., :16] | (low[..., 16:] << 4)
    bits = ((codes >> 4) & 1).to(torch.int64) << torch.arange(32)
    qh = bits.sum(-1).to(torch.uint32).view(torch.int32)
    return qs.contiguous(), qh.contiguous(), w.scale.half().contiguous()


def q5_matmul(
    x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] (bfloat16 or float32, contiguous) @ W.T -> float32 [M, N]."""
    qs, qh, d = packed
    rows, k = x.shape
    out = torch.empty(rows, qs.shape[0], dtype=torch.float32)
    status = q5_kernel().q5_gemv(
        x.data_ptr(), int(x.dtype == torch.bfloat16), rows, k,
        qs.data_ptr(), qh.data_ptr(), d.data_ptr(), qs.shape[0], out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise RuntimeError(f"q5_gemv failed (status {status}) for x {tuple(x.shape)}")
    return out
