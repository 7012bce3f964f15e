"""Which layout quantization= picks per device: int4 on a GPU comes in groups of 128 (the
tensor-core GEMV's smallest group), on the CPU in groups of 32 (torch's packed int4 kernel,
Q4_K's own layout)."""

from __future__ import annotations

import pytest
import torch

from nanoqwen.quant.scheme import Scheme, resolve_scheme

pytest.importorskip("triton", reason="the GPU layouts are the Triton kernels'")
from nanoqwen.kernels.triton.quant_gemv_mma import mma_gemv_fits  # noqa: E402
from nanoqwen.kernels.triton.quant_matmul import pack_for_triton  # noqa: E402


def test_int4_groups_per_device():
    assert resolve_scheme("int4", False, "cuda") == Scheme(4, 128)
    assert resolve_scheme("int4", False, "cpu") == Scheme(4, 32)
    assert resolve_scheme("int4", False) == Scheme(4, 32)
    # the rest does not depend on the device
    for device in ("cpu", "cuda"):
        assert resolve_scheme("int8", False, device) == Scheme(8, None)
        assert resolve_scheme("none", False, device) is None
        assert resolve_scheme("auto", True, device) == Scheme(8, None, True)


def test_gpu_int4_weights_take_the_tensor_core_gemv():
    w = torch.randn(64, 256) * 0.02
    qw = resolve_scheme("int4", False, "cuda").apply(w)
    assert qw.group_size == 128 and qw.offset is not None
    packed = pack_for_triton(qw.q, qw.scale, qw.offset, qw.group_size, qw.bits)
    assert mma_gemv_fits(torch.empty(1, 256, dtype=torch.bfloat16, device="meta"), packed)
