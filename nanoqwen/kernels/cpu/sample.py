"""ctypes wrapper of sampling.c: the sampler's step on the CPU in one C call.

`sampling_kernels()` is None where the library cannot be built (no C compiler) or
NANOQWEN_NATIVE=0; the sampler then keeps its torch ops (TorchPasses).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from nanoqwen.kernels import sampling_layout as layout
from nanoqwen.kernels.cpu.build import load_library

SOURCE = Path(__file__).with_name("sample.c")
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
# sampling.c's `layout` argument, in its enum's order.
LAYOUT = torch.tensor(
    [
        layout.F_TEMPERATURE, layout.F_TOP_P, layout.F_MIN_P, layout.F_REPETITION,
        layout.F_PRESENCE, layout.F_FREQUENCY, layout.NUM_F, layout.I_TOP_K,
        layout.I_MIN_TOKENS, layout.I_SEED, layout.I_FLAGS, layout.NUM_I, layout.FLAG_GREEDY,
        layout.FLAG_BAN,
    ],
    dtype=torch.int64,
)  # fmt: skip
PENALTIES, BANS, SAMPLED, FILTERING, RECORD = 1, 2, 4, 8, 16
MAX_CANDIDATES = 1024


@cache
def sampling_kernels() -> ctypes.CDLL | None:
    lib = load_library(SOURCE, "the C sampler is unavailable, using torch's ops")
    if lib is None:
        return None
    lib.sample_rows.argtypes = [
        _ptr, _i64, _i64, *[_ptr] * 9, _i64, _i64, _ptr, _ptr, _ptr, _int,
    ]  # fmt: skip
    lib.sample_rows.restype = ctypes.c_int
    return lib


def sample_rows(
    logits: torch.Tensor,
    slots: torch.Tensor,
    state,
    options: int,
    candidates: int,
    z: torch.Tensor | None = None,
    tau: torch.Tensor | None = None,
    tokens: torch.Tensor | None = None,
) -> None:
    """Runs sampling.c's sample_rows over the rows of float32 logits [rows, vocab] (slots:
    int64 [rows], distinct) with a SamplingState's tables; fills whichever of z [rows,
    vocab], tau [rows] (float32) and tokens [rows] (int64) are given."""
    logits = logits.float().contiguous()
    slots = slots.contiguous()
    rows, vocab = logits.shape

    def ptr(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    failed = sampling_kernels().sample_rows(
        logits.data_ptr(), rows, vocab, slots.data_ptr(), state.fparams.data_ptr(),
        state.iparams.data_ptr(), state.out_pos.data_ptr(), state.prompt_mask.data_ptr(),
        state.counts.data_ptr(), state.maybe_seen.data_ptr(), state.ban_mask.data_ptr(),
        LAYOUT.data_ptr(), options, candidates, ptr(z), ptr(tau), ptr(tokens),
        torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise RuntimeError(f"sample_rows failed ({failed}): candidates={candidates}")
