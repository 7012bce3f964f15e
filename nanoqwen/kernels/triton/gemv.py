"""Matrix-vector products for batch-1 decode of small projections.

At one token a projection is a pure weight stream, and for a small weight matrix cuBLAS's
M=1 kernels are latency bound (a 2-17 MB matrix read at 0.4-3.5 TB/s) and come with extra
kernels: a bias copy, a split-K reduce, the MLP's SiLU·up. A plain Triton kernel that gives
each program a few weight rows does the product and the bias or SiLU·up epilogue in one
launch. Inside the H200 decode graph: 0.5B's projections took 0.59 ms this way against
0.64 ms for cuBLAS with its extra kernels. Weights above GEMV_MAX_BYTES (7B's, 26-272 MB)
go to stream_gemv.py, which copies them in by TMA tiles. On sm_90+ the kernel launches as a
programmatic dependent (kernels/triton/pdl.py) with a wide first block of weights that loads
while the kernel in front still runs (PREFETCH_ELEMENTS; 0.5B's step on the H200: 8K
elements a program 0.710 ms against 16K's 0.646 in one run, 32K 0.647 against 0.645 in
another).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoqwen.kernels.triton.gemv_inputs import gemv_input, input_chunk, input_from, row_rstd
from nanoqwen.kernels.triton.pdl import use_pdl
from nanoqwen.kernels.triton.quant_gemv import sm_count
from nanoqwen.kernels.triton.silu_mul import _silu_mul
from nanoqwen.kernels.triton.stream_gemv import stream_gemv

GEMV_MAX_BYTES = 20 << 20
PREFETCH_ELEMENTS = 16384


def gemv_pays(weight: torch.Tensor) -> bool:
    """Whether a weight takes these kernels at one row: any contiguous one whose rows TMA can
    copy (16-byte aligned), the large ones by stream_gemv."""
    return weight.is_contiguous() and weight.shape[1] * weight.element_size() % 16 == 0


def _blocks(n: int, k: int) -> tuple[int, int]:
    """(rows, columns) of weight per program step, from a sweep over the Qwen2.5 shapes."""
    if k >= 4 * n:
        rows = 2  # long rows (down_proj): many programs
    elif n >= 4096:
        rows = 8  # many rows (0.5B's gate_up on two warps, _warps)
    elif n * k >= 8 << 20:
        rows = 4
    else:
        rows = 2
    return rows, columns(k, rows)


def columns(k: int, rows: int) -> int:
    """Columns of weight per program step for programs of this many rows."""
    return min(1024 if k <= 1024 else 512, 4096 // rows)


def _warps(n: int, k: int) -> int:
    # 0.5B's gate_up in the batch-1 chain (tools/gemv_chain_bench.py --sweep, H200): 4 rows
    # of gate and 4 of up on 2 warps 12.71 µs a layer against 13.41 for 8 and 8 on 4.
    return 2 if n >= 8192 and k <= 1024 else 4


def register_cap(programs: int, warps: int, sms: int) -> int | None:
    """ptxas' maxnreg that lets every program be resident at once, where registers would
    otherwise split the grid into waves: a second wave of a launch this short costs its
    whole latency again. 0.5B's gate_up with the norm in front: 1,216 programs of two warps,
    ten an SM at most 96 registers (the compiler's choice: 124). None where no cap is needed
    or none would do (a grid beyond what an SM's threads hold)."""
    per_sm = triton.cdiv(programs, sms)
    threads = per_sm * warps * 32
    if threads > 2048:
        return None
    cap = 65536 // threads // 8 * 8  # registers are allocated in eights a thread
    return cap if cap < 255 else None


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, res_ptr, nw_ptr, sum_ptr, ids_ptr, N, K, eps,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
    EMBED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BK0: tl.constexpr,
    REST: tl.constexpr, NORM_CHUNKS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """y = W x (+ b) for rows BN*pid..; with SILU_MUL, W holds gate rows then N up rows and
    y = silu(W_gate x) * (W_up x). With NORM, x is first RMSNorm(x + residual) * norm weight
    as rms_norm.py rounds it (every program normalizes the row for itself, NORM_CHUNKS =
    cdiv(K, BK); the first also stores x + residual to sum_ptr, the residual stream's next
    value). With EMBED, x_ptr is the embedding table and x its row at the token id ids_ptr
    holds (the first layer: no gather in front), stored to sum_ptr as the residual stream.
    The first BK0 columns of weights load in one block, under PDL before the wait for x's
    kernel."""
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    if PDL:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    r_mask = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    up_rows = w_rows + N * K
    cols0 = tl.arange(0, BK0)
    mask0 = r_mask[:, None] & (cols0 < K)[None, :]
    w_first = tl.load(w_rows + cols0[None, :], mask=mask0, other=0.0)
    up_first = w_first
    if SILU_MUL:
        up_first = tl.load(up_rows + cols0[None, :], mask=mask0, other=0.0)
    # The first weights above, and the norm weight and the bias, never change, so they load
    # before the wait: after it each was one more trip to memory on the way to the result.
    # (Not gate_up's norm weight: its 1,024 columns a program would spill under the register
    # cap that keeps its grid in one wave.)
    nw0 = tl.zeros([BK0], nw_ptr.dtype.element_ty)
    if NORM and not SILU_MUL:
        nw0 = tl.load(nw_ptr + cols0, mask=cols0 < K, other=0.0)
    bias = tl.zeros([BN], tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    if EMBED:
        x_ptr += tl.load(ids_ptr).to(tl.int64) * K
    rstd = 0.0
    if NORM:
        rstd = row_rstd(x_ptr, res_ptr, K, eps, HAS_RES, BK, NORM_CHUNKS)
    first = tl.program_id(0) == 0
    SUM: tl.constexpr = HAS_RES or EMBED
    v0 = input_chunk(x_ptr, res_ptr, cols0, cols0 < K, HAS_RES and NORM)
    if NORM:  # noqa: SIM102 (compile-time guards)
        if SILU_MUL:
            nw0 = tl.load(nw_ptr + cols0, mask=cols0 < K, other=0.0)
    x0 = input_from(v0, nw0, sum_ptr, cols0, cols0 < K, rstd, first, NORM, SUM, dtype)
    y = tl.sum(w_first.to(tl.float32) * x0, 1)
    y_up = tl.sum(up_first.to(tl.float32) * x0, 1)
    if REST:
        # Without it (a first block that covers the rows: every 0.5B projection under PDL)
        # no accumulators stay live, even through a loop of zero trips: 0.5B's gate_up went
        # from 8.5-10.2 to 5.3 µs a layer of a batch-1 step's critical path (H200).
        acc = tl.zeros([BN, BK], tl.float32)
        acc_up = tl.zeros([BN, BK], tl.float32)
        for k0 in range(BK0, K, BK):
            cols = k0 + tl.arange(0, BK)
            c_mask = cols < K
            mask = r_mask[:, None] & c_mask[None, :]
            x = gemv_input(x_ptr, res_ptr, nw_ptr, sum_ptr, cols, c_mask, rstd, first, NORM,
                           HAS_RES, SUM, dtype)  # fmt: skip
            acc += tl.load(w_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32) * x
            if SILU_MUL:
                up = tl.load(up_rows + cols[None, :], mask=mask, other=0.0)
                acc_up += up.to(tl.float32) * x
        y += tl.sum(acc, 1)
        y_up += tl.sum(acc_up, 1)
    y += bias
    if SILU_MUL:
        # Both projections round to the model dtype first, as the unfused path's GEMM does.
        y = _silu_mul(y.to(dtype), y_up.to(dtype), dtype)
    tl.store(y_ptr + rows, y.to(dtype), mask=r_mask)


def _first_block(k: int, rows: int, cols: int, pdl: bool) -> int:
    """Columns of the first block, which under PDL loads while the kernel in front runs: as
    much of the row as PREFETCH_ELEMENTS allow (a program's share of the weight in flight)."""
    if not pdl:
        return cols
    return max(cols, min(triton.next_power_of_2(k), PREFETCH_ELEMENTS // rows))


def _launch(x, weight, bias, n, rows, cols, silu_mul, norm=None, ids=None):
    """norm: (residual or None, norm weight, eps), for the RMSNorm prologue; returns
    (y, x + residual) then, else y. ids: x is an embedding table, the input its row at
    ids[0]."""
    if _streamed_size(weight):
        return stream_gemv(x, weight, bias, silu_mul, norm, ids=ids)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    pdl = use_pdl(x)
    first = _first_block(weight.shape[1], rows * (2 if silu_mul else 1), cols, pdl)
    x = x.contiguous()
    res, nw, eps = norm if norm is not None else (None, x, 0.0)
    stores = res is not None or ids is not None
    total = x.new_empty(1, weight.shape[1]) if stores else x
    programs, warps = triton.cdiv(n, rows), _warps(*weight.shape)
    cap = register_cap(programs, warps, sm_count(x.device)) if x.is_cuda else None
    _gemv_kernel[(programs,)](
        x, weight, weight if bias is None else bias, y,
        x if res is None else res.contiguous(), nw, total, x if ids is None else ids, n,
        weight.shape[1], eps, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        NORM=norm is not None, HAS_RES=res is not None, EMBED=ids is not None, BN=rows,
        BK=cols, BK0=first, REST=first < weight.shape[1],
        NORM_CHUNKS=triton.cdiv(weight.shape[1], cols), PDL=pdl, launch_pdl=pdl,
        num_warps=warps, num_stages=3, **({"maxnreg": cap} if cap else {}),
    )  # fmt: skip
    return y if norm is None else (y, total)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x of one row: [1, K] -> [1, N]."""
    n, k = weight.shape
    return _launch(x, weight, bias, n, *_blocks(n, k), silu_mul=False)


def gemv_silu_mul(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) for x of one row, gate_up = [W_gate; W_up]: [1, N]."""
    two_n, k = gate_up.shape
    rows, cols = _blocks(two_n, k)
    # Each program reads as many gate rows as up rows.
    return _launch(x, gate_up, None, two_n // 2, max(1, rows // 2), cols, silu_mul=True)


def norm_gemv(x, residual, norm_weight, eps: float, weight, bias=None):
    """gemv(rms_norm(x + residual) * norm_weight, weight, bias) for one row, with
    x + residual (a new tensor; x itself when residual is None): the add+RMSNorm in front of
    a projection, without its own launch."""
    n, k = weight.shape
    y, total = _launch(x, weight, bias, n, *_blocks(n, k), silu_mul=False,
                       norm=(residual, norm_weight, eps))  # fmt: skip
    return y, total


def embed_norm_gemv(table, ids, norm_weight, eps: float, weight, bias=None):
    """norm_gemv of the first layer's input, the embedding table's row at ids (one token),
    read by the GEMV itself: (y, that row)."""
    n, k = weight.shape
    return _launch(table, weight, bias, n, *_blocks(n, k), silu_mul=False,
                   norm=(None, norm_weight, eps), ids=ids)  # fmt: skip


def norm_gemv_silu_mul(x, residual, norm_weight, eps: float, gate_up):
    """gemv_silu_mul of the normalized row, and x + residual, as norm_gemv."""
    two_n, k = gate_up.shape
    rows, cols = _blocks(two_n, k)
    return _launch(x, gate_up, None, two_n // 2, max(1, rows // 2), cols, silu_mul=True,
                   norm=(residual, norm_weight, eps))  # fmt: skip


def _streamed_size(weight: torch.Tensor) -> bool:
    """Whether _launch hands this weight to stream_gemv."""
    return weight.numel() * weight.element_size() > GEMV_MAX_BYTES


def streams(weight: torch.Tensor) -> bool:
    """Whether one row through this weight runs stream_gemv (whose launches can add the
    residual after the product and take the add+RMSNorm from partial sums of squares)."""
    return gemv_pays(weight) and _streamed_size(weight)


def gemv_add(x, weight, bias, residual):
    """(residual + gemv(x, weight, bias), the float32 partial sums of its squares) for a
    weight that streams, HF's rounding of the residual add, in one launch."""
    return stream_gemv(x, weight, bias, residual=residual)


def squares_norm_gemv(stream, squares, norm_weight, eps: float, weight, bias=None,
                      silu_mul: bool = False):  # fmt: skip
    """gemv (or gemv_silu_mul) of RMSNorm(stream) * norm_weight for a weight that streams,
    the norm's 1 / RMS from squares (gemv_add's), in one launch."""
    return stream_gemv(stream, weight, bias, silu_mul, (None, norm_weight, eps),
                       squares=squares)[0]  # fmt: skip
