"""The CPU GGUF kernels (nanoqwen/quant/gguf_gemv.c): they read a Q5_0, Q8_0, Q6_K or Q4_K
tensor's own blocks and compute what llama.cpp's Q5_0/Q8_0 x Q8_0 dot products compute: activations
rounded to int8 per block of 32 (scale max|x| / 127), exact integer block sums, float32
scaling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import run_without_a_compiler
from tiny_gguf import random_blocks

from nanoqwen.kernels.cpu.gguf import (
    LANE_MAX_ROWS,
    MAX_ROWS,
    fifth_bit_planes,
    gguf_kernel,
    gguf_matmul,
    max_rows,
)
from nanoqwen.kernels.cpu.gguf_lanes import LANE_KINDS, from_lanes, to_lanes
from nanoqwen.quant.format import dequantize, quantize_int8, requantize_per_channel
from nanoqwen.quant.gguf_blocks import from_gguf_blocks
from nanoqwen.quant.gguf_forms import is_q5_0, is_q8_0, pack_q5_0, pack_q8_0, requantize_rows
from nanoqwen.quant.gguf_packed import from_file, to_canonical
from nanoqwen.quant.linear import CPU_PACKED_MAX_ROWS, QuantizedLinear

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(
    gguf_kernel() is None, reason="no C compiler or no AVX2: the GGUF kernels are not built"
)
PACK = {"Q5_0": pack_q5_0, "Q8_0": pack_q8_0}


def _blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])


def _expected(x: torch.Tensor, w_float: torch.Tensor) -> torch.Tensor:
    """The kernels' arithmetic in float64: x rounded per block to int8 (times the float32
    reciprocal of the scale, ties to even: bf16 inputs do hit ties), then exact sums."""
    rows, k = x.shape
    blocks = x.float().view(rows, k // 32, 32)
    dx = blocks.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(blocks * torch.where(dx > 0, 1 / dx, torch.zeros_like(dx)))
    x_rounded = (xq * dx).view(rows, k).double()
    return x_rounded @ w_float.double().T


def test_packed_layouts_are_the_files_own_bytes():
    raw = _blocks("Q5_0", 64, 256, seed=0)
    qs, qh, d = pack_q5_0(from_gguf_blocks("Q5_0", raw))
    blocks = raw.reshape(64, 8, 22)
    assert np.array_equal(d.view(torch.uint8).numpy().reshape(64, 8, 2), blocks[..., 0:2])
    assert np.array_equal(qh.view(torch.uint8).numpy().reshape(64, 8, 4), blocks[..., 2:6])
    assert np.array_equal(qs.numpy(), blocks[..., 6:22])
    raw = _blocks("Q8_0", 64, 256, seed=1)
    qs, d = pack_q8_0(from_gguf_blocks("Q8_0", raw))
    blocks = raw.reshape(64, 8, 34)
    assert np.array_equal(d.view(torch.uint8).numpy().reshape(64, 8, 2), blocks[..., 0:2])
    codes = (qs.numpy().astype(np.int16) - 128).astype(np.int8).view(np.uint8)
    assert np.array_equal(codes, blocks[..., 2:34])


def _lane_packed(type_name: str, raw: np.ndarray) -> tuple[torch.Tensor, ...]:
    """Q5_0 and Q8_0 packed from the canonical weight, the others as the file's blocks, then
    put in the kernel's lanes."""
    if type_name in PACK:
        packed = PACK[type_name](from_gguf_blocks(type_name, raw))
    else:
        packed = from_file(type_name, raw).tensors
    return to_lanes(type_name.lower(), packed, planes=fifth_bit_planes())


@pytest.mark.parametrize("type_name", [*PACK, "Q4_0", "Q4_1", "Q5_1"])
@pytest.mark.parametrize("rows", [1, 3, LANE_MAX_ROWS])
# 96: 3 blocks (one group of 3 lanes); 1024: two groups of 16; 896: 16 + 12, the default
# model's hidden size
@pytest.mark.parametrize("k", [96, 1024, 896])
def test_kernel_equals_int8_activation_reference(type_name, rows, k):
    """The weight in lanes (Q4_1 and Q5_1 with a min a block, as the offset term's factor),
    against the float64 product of the dequantized weight."""
    raw = _blocks(type_name, 80, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0  # an all-zero block: scale 0
    ref = _expected(x.bfloat16(), dequantize(from_gguf_blocks(type_name, raw)))
    packed = _lane_packed(type_name, raw)
    for xin in (x.bfloat16().float(), x.bfloat16().half()):  # the same values
        got = gguf_matmul(xin, type_name.lower(), packed)
        assert got.shape == (rows, 80) and got.dtype == torch.float32
        # Integer sums are exact; float32 scaling and accumulation of k / 32 block terms.
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    # bfloat16 activations: the same sums, rounded in the kernel as .to(bfloat16) rounds them,
    # and a bias added after that rounding as F.linear's bias add would.
    bias = torch.randn(80).bfloat16()
    kind = type_name.lower()
    sums = gguf_matmul(x.bfloat16().float(), kind, packed)
    assert torch.equal(gguf_matmul(x.bfloat16(), kind, packed), sums.bfloat16())
    assert torch.equal(gguf_matmul(x.bfloat16(), kind, packed, bias), sums.bfloat16() + bias)


@pytest.mark.parametrize("type_name", [*PACK, "Q4_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("rows", [13, LANE_MAX_ROWS])
def test_verify_rows_equal_decode_rows(type_name, rows):
    """A speculative verify step's rows, in one call, each bit for bit what that row alone (a
    decode step) gives: float32, and bfloat16 with a bias. 40 outputs: 16, 16 and a partial
    block of 8; k = 896: a group of 16 blocks and one of 12 (the K-quants: 4864, the default
    model's down_proj, 9 groups and one of 8)."""
    k_quant = type_name.endswith("_K")
    k = 4864 if k_quant else 896
    raw = random_blocks(type_name, 40, k, seed=rows) if k_quant else _blocks(type_name, 40, k, rows)
    packed, kind = _lane_packed(type_name, raw), type_name.lower()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    bias = torch.randn(40, generator=torch.Generator().manual_seed(1)).bfloat16()
    for xin, b in ((x.float(), None), (x, bias)):
        together = gguf_matmul(xin, kind, packed, b)
        alone = torch.cat([gguf_matmul(xin[i : i + 1], kind, packed, b) for i in range(rows)])
        assert torch.equal(together, alone)
    assert not torch.equal(together[0], together[1])  # rows are told apart


def fifth_bit(high: torch.Tensor, planes: bool, g: int, j: int, c: int) -> np.ndarray:
    """Each row's fifth bit of code c of block j of group g, from to_lanes' masks (bit 4j + i
    of mask s, for code 4s + i) or bit planes (bit s of byte 4j + i)."""
    if planes:
        byte = high.numpy().view(np.uint8).reshape(high.shape[0], -1, 64)[:, g, 4 * j + c % 4]
        return (byte >> (c // 4)) & 1
    masks = high.numpy().view(np.uint64)
    return (masks[:, g, c // 4] >> np.uint64(4 * j + c % 4)) & 1


@pytest.mark.parametrize("planes", [False, True], ids=["masks", "planes"])
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
def test_k_quant_lanes_hold_blocks_of_32(type_name, planes):
    """Q4_K's and Q5_K's codes in lanes are the canonical weight's blocks of 32 in Q4_0's
    nibble order (byte j: codes j and j + 16), their fifth bits as Q5_0's, their six-bit scales
    and mins one a block; from_lanes undoes it."""
    raw = random_blocks(type_name, 4, 512, seed=3)
    file = from_file(type_name, raw)
    lanes = to_lanes(file.kind, file.tensors, planes=planes)
    canonical = to_canonical(file)  # codes 0..15 (0..31 with the fifth bit) a value
    q = canonical.q.numpy().view(np.uint8).reshape(4, 16, 32)
    codes = lanes[0].numpy()
    for b in range(16):  # one group of 16 lanes; vector v at byte 64v
        for v in range(4):
            got = codes[:, 64 * v + 4 * b : 64 * v + 4 * b + 4]
            want = (q[:, b, 4 * v : 4 * v + 4] & 15) | (q[:, b, 16 + 4 * v : 20 + 4 * v] & 15) << 4
            assert np.array_equal(got, want)
    if type_name == "Q5_K":
        for b in range(16):
            for c in range(32):
                assert np.array_equal(fifth_bit(lanes[1], planes, 0, b, c), q[:, b, c] >> 4)
    sc, m = lanes[-4].numpy(), lanes[-3].numpy()
    assert sc.shape == m.shape == (4, 16)
    assert np.array_equal(sc, file.tensors[-4].numpy().reshape(4, 16))
    back = from_lanes(file.kind, lanes, planes=planes)
    assert all(torch.equal(a, b) for a, b in zip(back, file.tensors))


def test_q6_k_lanes_hold_groups_of_16():
    """Q6_K in lanes: lane j of a superblock holds its values 16j..16j+15, vector v values
    16j + 4v..4v+3: the low nibbles of vectors 0 and 2 in one vector's bytes (low and high
    nibble), of 1 and 3 in the next, the top two bits of vectors 0-3 in the third (bits 2v, 2v
    + 1); the scales one a lane. from_lanes undoes it."""
    raw = random_blocks("Q6_K", 4, 512, seed=5)
    file = from_file("Q6_K", raw)
    codes, sc, d = to_lanes("q6_k", file.tensors, planes=False)
    values = to_canonical(file).q.numpy().astype(np.int16) + 32  # 0..63, [4, 512]
    b = codes.numpy().reshape(4, 2, 3, 16, 4)  # superblock, vector kind, lane, byte
    for v in range(4):
        want = values.reshape(4, 2, 16, 4, 4)[:, :, :, v]  # [row, superblock, lane, byte]
        low = (b[:, :, v % 2] >> (4 * (v // 2))) & 15
        top = (b[:, :, 2] >> (2 * v)) & 3
        assert np.array_equal(low | top << 4, want)
    assert torch.equal(sc, file.tensors[2].reshape(4, 32))
    back = from_lanes("q6_k", (codes, sc, d), planes=False)
    assert all(torch.equal(a, b) for a, b in zip(back, file.tensors))


@pytest.mark.parametrize("planes", [False, True], ids=["masks", "planes"])
@pytest.mark.parametrize("type_name", ["Q5_0", "Q8_0", "Q4_0", "Q5_1", "Q4_1"])
def test_lanes_hold_the_files_bytes(type_name, planes):
    """gguf_lanes' layout as gguf_gemv.c reads it: lane j of vector v of a group of w blocks
    is block j's code bytes 4v..4v+3, at byte 4w v of the group; the fifth bits as masks,
    bit 4j + i of mask s = block j's code 4s + i, or as bit planes, bit s of byte 4j + i.
    from_lanes undoes it."""
    raw = _blocks(type_name, 4, 896, seed=7)
    file = from_file(type_name, raw)
    lanes = to_lanes(file.kind, file.tensors, planes=planes)
    qs, codes = file.tensors[0].numpy(), lanes[0].numpy()
    size = qs.shape[-1]
    for g, w in ((0, 16), (1, 12)):
        group = codes[:, 16 * g * size : (16 * g + w) * size]
        for v in range(size // 4):
            for j in range(w):
                got = group[:, 4 * w * v + 4 * j : 4 * w * v + 4 * j + 4]
                assert np.array_equal(got, qs[:, 16 * g + j, 4 * v : 4 * v + 4])
    if type_name in ("Q5_0", "Q5_1"):
        qh = file.tensors[1].numpy().view(np.uint32)
        assert lanes[1].shape == (4, 2, 8)
        for b in range(28):
            for c in range(32):
                bit = fifth_bit(lanes[1], planes, b // 16, b % 16, c)
                assert np.array_equal(bit, (qh[:, b] >> c) & 1)
        # The short last group's missing blocks hold no bits.
        assert not any(
            fifth_bit(lanes[1], planes, 1, j, c).any() for j in (12, 15) for c in (0, 31)
        )
    back = from_lanes(file.kind, lanes, planes=planes)
    assert all(torch.equal(a, b) for a, b in zip(back, file.tensors))
    assert file.kind in LANE_KINDS


@pytest.mark.parametrize(
    ("type_name", "kind"),
    [("Q6_K", "q6_k"), ("Q4_K", "q4_k"), ("Q5_K", "q5_k"), ("Q3_K", "q3_k"), ("Q2_K", "q2_k")],
)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS, LANE_MAX_ROWS])
@pytest.mark.parametrize("k", [256, 4864])  # 4864: the default model's down_proj
def test_k_quant_kernels_equal_int8_activation_reference(type_name, kind, rows, k):
    """The K-quants read from the file's superblocks (Q4_K and Q5_K put in lanes): the same
    arithmetic as Q5_0/Q8_0's, with a scale a 16 values (Q6_K, Q3_K; Q2_K with a min too) or
    a scale and a min a 32 (Q4_K, Q5_K)."""
    if rows > max_rows(kind):
        pytest.skip(f"{kind} takes {max_rows(kind)} rows a call")
    raw = random_blocks(type_name, 80, k, seed=rows)  # any code, scale and high-bit pattern
    packed = from_file(type_name, raw)
    assert packed.kind == kind and packed.shape == (80, k)
    planes = fifth_bit_planes()
    tensors = (
        to_lanes(kind, packed.tensors, planes=planes) if kind in LANE_KINDS else packed.tensors
    )
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0
    ref = _expected(x.bfloat16(), dequantize(from_gguf_blocks(type_name, raw)))
    got = gguf_matmul(x.bfloat16().float(), kind, tensors)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    bias = torch.randn(80).bfloat16()
    assert torch.equal(gguf_matmul(x.bfloat16(), kind, tensors, bias), got.bfloat16() + bias)


def test_layouts_are_told_apart():
    q5 = from_gguf_blocks("Q5_0", _blocks("Q5_0", 8, 64, seed=1))
    q8 = from_gguf_blocks("Q8_0", _blocks("Q8_0", 8, 64, seed=2))
    assert is_q5_0(q5) and is_q8_0(q5)  # Q5_0's codes are Q8_0 codes too
    assert is_q8_0(q8) and not is_q5_0(q8)  # codes beyond -16..15
    w = torch.randn(8, 64)
    assert not is_q8_0(quantize_int8(w, 16))  # groups of 16 (Q6_K's)
    assert not is_q8_0(quantize_int8(w))  # one scale per row
    assert not is_q8_0(quantize_int8(w, 32))  # scales that float16 would round


@pytest.mark.parametrize(("type_name", "kind"), [("Q5_0", "q5_0"), ("Q8_0", "q8_0")])
def test_layer_uses_the_kernel_for_decode_rows_in_bf16_only(type_name, kind):
    w = from_gguf_blocks(type_name, _blocks(type_name, 48, 128, seed=3))
    bias = torch.randn(48, generator=torch.Generator().manual_seed(3))
    ref_w = dequantize(w)
    bf16 = QuantizedLinear(w, bias.clone())
    bf16.prepare(torch.bfloat16)
    assert bf16.kind == kind
    x = torch.randn(CPU_PACKED_MAX_ROWS, 128, generator=torch.Generator().manual_seed(4))
    got = bf16(x.bfloat16())
    product = _expected(x.bfloat16(), ref_w)
    want = product + bias.bfloat16().double()
    assert got.dtype == torch.bfloat16
    # Two bf16 roundings, each within 2^-8 of its value: the product, then its sum with the
    # bias (plus float32's summation order). The bound used before, 2^-8 of max|want|,
    # failed for 8 of 300 seeded biases: the unseeded bias made this test flaky.
    bound = 2**-8 * (product.abs() + want.abs()) + 1e-6 * product.abs().max()
    assert ((got.double() - want).abs() <= bound).all()
    f32 = QuantizedLinear(w, bias.clone())
    f32.prepare(torch.float32)
    assert f32.kind == "dequant"  # float32 is the exact mode: no activation rounding
    torch.testing.assert_close(f32(x), F.linear(x, ref_w, bias), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("type_name", list(PACK))
def test_per_channel_copy_for_prefill(type_name):
    """The per-channel int8 copy the many-row matmul reads: C and torch agree exactly, and both
    are the float weight quantized per row (a code may differ by one at a rounding tie)."""
    w = from_gguf_blocks(type_name, _blocks(type_name, 40, 256, seed=5))
    fast, slow = requantize_rows(w), requantize_per_channel(w)
    assert torch.equal(fast.q, slow.q) and torch.equal(fast.scale, slow.scale)
    assert fast.per_channel and fast.bits == 8
    ref = quantize_int8(dequantize(w))
    assert torch.equal(fast.scale, ref.scale)
    assert (fast.q.int() - ref.q.int()).abs().max() <= 1


def test_without_a_compiler_the_layers_keep_torchs_kernels(tmp_path):
    """A failed build is one note on stderr; Q5_0 layers then run torch's per-channel int8."""
    script = (
        "import torch, numpy as np, gguf\n"
        "from nanoqwen.quant.gguf_blocks import from_gguf_blocks\n"
        "from nanoqwen.quant.linear import QuantizedLinear\n"
        "from nanoqwen.kernels.cpu.gguf import gguf_kernel\n"
        "w = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)\n"
        "raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0)\n"
        "layer = QuantizedLinear(from_gguf_blocks('Q5_0', raw), None)\n"
        "layer.prepare(torch.bfloat16)\n"
        "print(gguf_kernel(), layer.kind)\n"
    )
    done = run_without_a_compiler(script, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "int8pack"]
    assert "GGUF CPU kernels unavailable, using torch's int8 kernel" in done.stderr


@pytest.mark.parametrize("type_name", ["Q5_0", "Q8_0", "Q6_K", "Q4_K"])
def test_no_rows_give_no_rows(type_name):
    """A prefill chunk that ends no prompt asks the lm_head for the logits of no rows."""
    packed = from_file(type_name, random_blocks(type_name, 80, 256, seed=0))
    planes = fifth_bit_planes()
    lanes = packed.kind in LANE_KINDS
    tensors = to_lanes(packed.kind, packed.tensors, planes=planes) if lanes else packed.tensors
    for dtype in (torch.bfloat16, torch.float32):
        out = gguf_matmul(torch.empty(0, 256, dtype=dtype), packed.kind, tensors)
        assert out.shape == (0, 80) and out.dtype == dtype
