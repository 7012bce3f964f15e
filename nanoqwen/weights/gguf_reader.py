"""A minimal GGUF (v2/v3) reader: metadata and tensor views of a memory-mapped file.

gguf-py's GGUFReader builds a numpy view per metadata element, which takes ~50 s for the
300,000 strings of a Qwen2 tokenizer on this project's machines; parsing the same header
with struct takes well under a second. Type constants (block sizes) come from the gguf
package.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass
class RawTensor:
    name: str  # the GGUF's own name (blk.0.attn_q.weight)
    type_name: str  # ggml type: F32, Q8_0, ...
    dims: tuple[int, ...]  # fastest-varying first, as GGUF lists them
    data: np.ndarray  # F32/F16/BF16: [rows..., cols] values; quantized: [rows, bytes per row]
    offset: int  # where data starts in the file


class _Cursor:
    def __init__(self, buf) -> None:
        # Strings are read through a memoryview: slicing the np.memmap builds a memmap
        # object per string, half of the header's ~0.5 s.
        self.buf, self.view, self.pos = buf, memoryview(buf), 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.view, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        text = str(self.view[self.pos : self.pos + n], "utf-8", "replace")
        self.pos += n
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            fmt = _SCALARS[item]
            size = struct.calcsize(fmt)
            values = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=self.pos)
            self.pos += size * count
            return values.tolist()
        return self.scalar(_SCALARS[kind])


def read_gguf(path: Path) -> tuple[dict[str, Any], list[RawTensor]]:
    """(metadata, tensors) of a GGUF file; ValueError when it is not one."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(data)
    if bytes(data[:4]) != b"GGUF":
        raise ValueError("no GGUF magic number")
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (allowed 2 or 3)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
        infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    align = int(meta.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    tensors = []
    for name, dims, kind, offset in infos:
        qtype = GGMLQuantizationType(kind)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(dims[1:], dtype=np.int64))
        row_bytes = dims[0] // block * block_bytes
        begin = start + offset
        raw = data[begin : begin + rows * row_bytes].reshape(rows, row_bytes)
        if qtype.name in ("F32", "F16"):
            raw = raw.view(np.float32 if qtype.name == "F32" else np.float16)
            raw = raw.reshape(*reversed(dims))
        tensors.append(RawTensor(name, qtype.name, dims, raw, begin))
    return meta, tensors
