"""The C libraries' build cache (nanoqwen/kernels/cpu/build.py): keyed on the source and every
header it includes, so that editing a shared header rebuilds each library that uses it."""

from __future__ import annotations

import ctypes

import pytest

from nanoqwen.kernels.cpu import build
from nanoqwen.kernels.cpu.cpu_ops import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C compiler here")


def test_an_edited_header_rebuilds_the_library(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    (src / "inc").mkdir(parents=True)
    (src / "inc" / "value.h").write_text('#include "../more.h"\n#define VALUE 1\n')
    (src / "more.h").write_text("#define MORE 10\n")
    source = src / "lib.c"
    source.write_text('#include "inc/value.h"\nint value(void) { return VALUE + MORE; }\n')
    assert build._with_headers(source) == [
        source.resolve(),
        (src / "inc" / "value.h").resolve(),
        (src / "more.h").resolve(),
    ]

    def value() -> int:
        lib = build.load_library(source, "test")
        lib.value.restype = ctypes.c_int
        return lib.value()

    assert value() == 11
    (src / "more.h").write_text("#define MORE 20\n")  # a header's header
    assert value() == 21
    assert len(list(build.cache_dir().glob("lib-*.so"))) == 2
    assert value() == 21  # unchanged sources: the cached library, no third build
    assert len(list(build.cache_dir().glob("lib-*.so"))) == 2
