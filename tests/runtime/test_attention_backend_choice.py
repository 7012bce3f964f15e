"""Which attention backend each setup gets (create_backend), without a GPU: the CUDA checks
are answered by monkeypatching, and no kernel runs."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from nanoqwen.attention.backends import create_backend
from nanoqwen.attention.rotary import RotaryEmbedding
from nanoqwen.errors import InvalidInputError

pytest.importorskip("triton")
CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


@pytest.fixture
def hopper(monkeypatch):
    """torch reports an sm90 GPU; `import flash_attn` fails unless a test installs a fake."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "flash_attn", None)


@pytest.fixture
def fake_flash_attn(monkeypatch):
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = module.flash_attn_with_kvcache = lambda *a, **k: None
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface.flash_attn_gpu = types.SimpleNamespace(varlen_fwd=lambda *a: None)
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)


def _backend(name, device=CUDA, dtype=torch.bfloat16, head_dim=64, block_size=256):
    rotary = RotaryEmbedding(head_dim, 16, 1e6, "cpu")
    return create_backend(name, rotary, head_dim**-0.5, device, dtype, head_dim, block_size)


@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("name", ["auto", "triton"])
def test_triton_serves_any_block_size_without_flash_attn(hopper, name, block_size):
    backend = _backend(name, block_size=block_size)
    assert backend.name == "triton" and backend.flash is None
    assert backend.graph_variants(4096) == [(4096, 0)]


def test_triton_uses_flash_attn_only_where_it_fits(hopper, fake_flash_attn):
    assert _backend("triton", block_size=256).flash is not None
    assert _backend("triton", block_size=512).flash is not None
    assert _backend("auto", block_size=64).flash is None
    assert _backend("flash-attn", block_size=256).name == "flash-attn"


@pytest.mark.parametrize(
    ("name", "kwargs", "problem"),
    [
        ("flash-attn", {"block_size": 16}, "block_size 16 is not a multiple of 256"),
        ("flash-attn", {}, "flash_attn does not import"),
        ("triton", {"dtype": torch.float32}, "it needs float16 or bfloat16, not float32"),
        ("triton", {"head_dim": 96}, "head_dim 96 is not supported (64, 128)"),
        ("triton", {"device": torch.device("cpu")}, "it needs a CUDA device"),
        ("native", {}, "it runs on the CPU only"),
        ("native", {"device": CPU, "dtype": torch.float32}, "it needs bfloat16, not float32"),
    ],
)
def test_unavailable_backends_say_why(hopper, name, kwargs, problem):
    with pytest.raises(InvalidInputError, match=f"attention_backend='{name}' is unavailable ") as e:
        _backend(name, **kwargs)
    assert problem in str(e.value) and "\n" not in str(e.value)


def test_flash_attn_needs_blocks_of_256(hopper, fake_flash_attn):
    with pytest.raises(ValueError, match="block_size 16 is not a multiple of 256"):
        _backend("flash-attn", block_size=16)


@pytest.mark.parametrize(
    "kwargs",
    [{"dtype": torch.float32}, {"head_dim": 96}, {"device": CPU, "dtype": torch.float32}],
    ids=["float32", "head_dim-96", "cpu-float32"],
)
def test_auto_falls_back_to_torch(hopper, kwargs):
    assert _backend("auto", **kwargs).name == "torch"


def test_auto_takes_the_c_kernels_on_a_cpu_in_bfloat16(monkeypatch):
    from nanoqwen.kernels.cpu.cpu_ops import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("no C compiler here")
    assert _backend("auto", device=CPU).name == "native"
    assert _backend("native", device=CPU, head_dim=96).name == "native"  # any head size
    monkeypatch.setenv("NANOQWEN_NATIVE", "0")
    assert _backend("auto", device=CPU).name == "torch"
    with pytest.raises(InvalidInputError, match="NANOQWEN_NATIVE=0 turns it off"):
        _backend("native", device=CPU)
