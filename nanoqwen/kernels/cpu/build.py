"""Compiles a C source of the package at first use with the system C compiler (FLAGS, then
any flags in NANOQWEN_CFLAGS) into a cache directory, and loads
it; the library is then reused until the source, a header it includes, those flags or the CPU
change. NANOQWEN_NATIVE=0 turns every such library off."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("NANOQWEN_CACHE") or os.environ.get("XDG_CACHE_HOME")
    return Path(root or Path.home() / ".cache") / "nanoqwen"


def native_enabled() -> bool:
    return os.environ.get("NANOQWEN_NATIVE", "1") != "0"


# -fno-trapping-math lets GCC turn the float compares of a clamp or select into vector
# blends, so loops over exp_approx vectorize (-ftrapping-math kept SiLU·up scalar: 36.5 µs for
# one row of 4,864 against 10.7, an AVX2 CPU). The flag reorders no arithmetic; the loops it
# lets vectorize under `omp simd reduction` (attention's softmax sum, the sampler's) then add
# in vector order, as those pragmas allow.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math")


def extra_flags() -> list[str]:
    """NANOQWEN_CFLAGS, after the defaults: e.g. -mno-avx512f builds the AVX2 kernels on an
    AVX-512 CPU."""
    return shlex.split(os.environ.get("NANOQWEN_CFLAGS", ""))


def _compile(source: Path, target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed: test processes may build at the same time.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler, *FLAGS, *extra_flags(), "-shared", "-fPIC"]
    cmd += [str(source), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise OSError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
    os.replace(tmp, target)


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def _with_headers(source: Path) -> list[Path]:
    """source and every header it includes with quotes, transitively: what the library is
    built from, so that an edit to any of them rebuilds it."""
    found, todo = [source.resolve()], [source.resolve()]
    while todo:
        path = todo.pop()
        for line in path.read_text().splitlines():
            match = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if match:
                header = (path.parent / match.group(1)).resolve()
                if header not in found:
                    found.append(header)
                    todo.append(header)
    return found


def load_library(source: Path, fallback: str) -> ctypes.CDLL | None:
    """source's library, or None with one note on stderr naming the fallback where it cannot
    be built or loaded here (or NANOQWEN_NATIVE=0)."""
    if not native_enabled():
        return None
    # -march=native: a library built on one CPU is kept for that CPU only (shared home dirs).
    parts = [p.read_bytes() for p in _with_headers(source)]
    built_for = (_cpu_flags() + "\0" + "\0".join((*FLAGS, *extra_flags()))).encode()
    key = hashlib.sha256(b"".join(parts) + built_for).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    try:
        if not target.is_file():
            _compile(source, target)
        return ctypes.CDLL(str(target))
    except OSError as e:
        print(f"[nanoqwen] {fallback}: {e}", file=sys.stderr)
        return None
