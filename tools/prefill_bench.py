"""Paged prefill on the GPU: the Triton kernel against flash-attn, and the engine per block size.

`kernels`: GPU time of one layer's prefill attention (CUDA graph of 10 calls, bf16) for a
batch of sequences at the 0.5B and 7B head shapes: fresh prompts of --prompt-len tokens, and
the last chunk of a chunked prefill (a quarter of the prompt over the rest, cached). Rows:
rope_and_store alone (RoPE + K/V write, which runs before the Triton kernel), the Triton
kernel at block sizes 16..256, and where flash-attn imports, flash_attn_varlen_func over the
same paged cache (block 256, as the flash-attn backend calls it) and over contiguous K/V
(flash-attn's own best case). `--sweep` also times other tile configurations of the kernel.

`engine`: the triton backend at block sizes 16..256 with flash-attn hidden (pure Triton), and
at 256 with flash-attn where it imports: the throughput workload of `nanoqwen bench`,
batch-1 decode steps and the TTFT of 8 prompts of 2,048 tokens.

Usage: python3 tools/prefill_bench.py kernels [--shapes 0.5B,7B] [--sweep]
       python3 tools/prefill_bench.py engine --shape 0.5B [--block-sizes 16,32,64,128,256]
Both write JSON with --json PATH.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import random
import sys

import gpu_timing
import torch

import nanoqwen.kernels.triton.prefill_attention as pa
from nanoqwen.attention.rotary import RotaryEmbedding
from nanoqwen.kernels.triton.rope import rope_and_store
from nanoqwen.model.shapes import shape_config

BLOCK_SIZES = (16, 32, 64, 128, 256)

graph_us = functools.partial(gpu_timing.graph_us, reps=10, iters=20)


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def flash_attn_hidden():
    """`import flash_attn` fails inside, as on a machine without it."""
    saved = sys.modules.get("flash_attn")
    sys.modules["flash_attn"] = None
    try:
        yield
    finally:
        if saved is None:
            del sys.modules["flash_attn"]
        else:
            sys.modules["flash_attn"] = saved


def attention_flop(heads: int, head_dim: int, seqs: int, cached: int, new: int) -> float:
    """Causal attention work: each new query against the keys it sees, QK and PV."""
    visible = seqs * (new * cached + new * (new + 1) / 2)
    return 4 * heads * head_dim * visible


class PrefillCase:
    """One layer's prefill: seqs sequences, each with `new` new tokens over `cached` cached
    ones, laid out in the paged cache of one block size (blocks shuffled)."""

    def __init__(
        self, shape: str, seqs: int, cached: int, new: int, block: int, device="cuda", dtype=None
    ) -> None:
        cfg = shape_config(shape)
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        dev, dtype = torch.device(device), dtype or torch.bfloat16
        gen = torch.Generator(device=dev).manual_seed(0)
        total = cached + new
        width = -(-total // block)
        self.blocks = seqs * width + 1
        self.k_cache = torch.randn(self.blocks, block, kvh, d, device=dev, dtype=dtype)
        self.v_cache = torch.randn_like(self.k_cache)
        perm = torch.randperm(self.blocks - 1, device=dev, generator=gen)
        self.tables = perm.to(torch.int32).view(seqs, width)
        pos = torch.arange(cached, total, device=dev)
        self.positions = pos.repeat(seqs)
        rows = torch.arange(seqs, device=dev).repeat_interleave(new)
        self.slots = self.tables[rows, self.positions // block].long() * block + (
            self.positions % block
        )
        self.qkv = torch.randn(seqs * new, (h + 2 * kvh) * d, device=dev, dtype=dtype)
        i32 = dict(dtype=torch.int32, device=dev)
        self.cu_q = torch.arange(0, seqs + 1, **i32) * new
        self.cu_k = torch.arange(0, seqs + 1, **i32) * total
        self.ctx = torch.full((seqs,), total, **i32)
        self.rotary = RotaryEmbedding(d, 40960, cfg.rope_theta, dev)
        self.h, self.kvh, self.d, self.new, self.total = h, kvh, d, new, total
        q, k, v = self.qkv.split([h * d, kvh * d, kvh * d], -1)
        self.q, self.k = q.view(-1, h, d), k.view(-1, kvh, d)
        self.v = v.view(-1, kvh, d)
        self.flop = attention_flop(h, d, seqs, cached, new)

    def rope_store(self) -> None:
        rope_and_store(
            self.q, self.k, self.positions, self.rotary.cos_half, self.rotary.sin_half,
            self.slots, self.k_cache, self.v_cache,
        )  # fmt: skip

    def triton(self, config=None) -> None:
        pa.prefill_attention(
            self.q, self.k_cache, self.v_cache, self.tables, self.cu_q, self.ctx, self.new,
            self.d**-0.5, config=config,
        )  # fmt: skip

    def flash_paged(self) -> None:
        from flash_attn import flash_attn_varlen_func

        flash_attn_varlen_func(
            self.q, self.k_cache, self.v_cache, cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k,
            max_seqlen_q=self.new, max_seqlen_k=self.total, softmax_scale=self.d**-0.5,
            causal=True, block_table=self.tables,
        )  # fmt: skip

    def flash_contiguous(self):
        """Contiguous K/V of the whole context (cached + new) per sequence."""
        from flash_attn import flash_attn_varlen_func

        k = self.k_cache[self.tables].flatten(1, 2)[:, : self.total].flatten(0, 1).contiguous()
        v = self.v_cache[self.tables].flatten(1, 2)[:, : self.total].flatten(0, 1).contiguous()
        q = self.q.contiguous()
        return lambda: flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k, max_seqlen_q=self.new,
            max_seqlen_k=self.total, softmax_scale=self.d**-0.5, causal=True,
        )  # fmt: skip


def check_against_flash(case: PrefillCase) -> float:
    """Max abs difference between the Triton kernel and flash-attn on this case."""
    from flash_attn import flash_attn_varlen_func

    ours = pa.prefill_attention(
        case.q, case.k_cache, case.v_cache, case.tables, case.cu_q, case.ctx, case.new,
        case.d**-0.5,
    )  # fmt: skip
    ref = flash_attn_varlen_func(
        case.q, case.k_cache, case.v_cache, cu_seqlens_q=case.cu_q, cu_seqlens_k=case.cu_k,
        max_seqlen_q=case.new, max_seqlen_k=case.total, softmax_scale=case.d**-0.5,
        causal=True, block_table=case.tables,
    )  # fmt: skip
    return (ours.float() - ref.float()).abs().max().item()


def kernels(args) -> dict:
    flash = flash_attn_available()
    print(f"flash-attn importable: {flash}; times in µs per call, one layer, bf16")
    results = []
    for shape in args.shapes.split(","):
        quarter = args.prompt_len // 4
        for label, cached, new in (
            (f"{args.seqs} x {args.prompt_len} prompt", 0, args.prompt_len),
            (f"{args.seqs} x {quarter} chunk over {args.prompt_len - quarter}",
             args.prompt_len - quarter, quarter),
        ):  # fmt: skip
            row: dict = {"shape": shape, "case": label}
            for block in BLOCK_SIZES:
                case = PrefillCase(shape, args.seqs, cached, new, block)
                if block == 256:
                    row["rope_and_store"] = graph_us(case.rope_store)
                row[f"triton block {block}"] = graph_us(case.triton)
                if block == 256 and flash:
                    row["max abs diff vs flash-attn"] = check_against_flash(case)
                    row["flash-attn paged 256"] = graph_us(case.flash_paged)
                    row["flash-attn contiguous"] = graph_us(case.flash_contiguous())
                if block == 256 and args.sweep:
                    for tiles in sweep_configs(case.d):
                        try:
                            t = graph_us(functools.partial(case.triton, tiles))
                        except Exception as e:  # out of shared memory, etc.
                            print(f"  config {tiles}: {type(e).__name__}", flush=True)
                            continue
                        row[f"triton 256 config {tiles}"] = t
            case = None
            torch.cuda.empty_cache()
            cfg = shape_config(shape)
            flop = attention_flop(cfg.num_attention_heads, cfg.head_dim, args.seqs, cached, new)
            best = min((v, k) for k, v in row.items() if k.startswith("triton"))
            print(
                f"\n{shape}, {label} ({flop / row['triton block 256'] / 1e6:.0f} TFLOP/s at 256):"
            )
            for k, v in row.items():
                if isinstance(v, float):
                    print(f"  {k:40s} {v:10.{4 if k.startswith('max') else 1}f}")
            if flash:
                for ref in ("flash-attn paged 256", "flash-attn contiguous"):
                    print(f"  triton 256 / {ref}: {row['triton block 256'] / row[ref]:.2f}x")
            print(f"  fastest Triton: {best[1]} {best[0]:.1f}", flush=True)
            results.append(row)
    return {"flash_attn": flash, "kernels": results}


def sweep_configs(head_dim: int):
    for bm in (64, 128):
        for bn in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    if head_dim == 128 and bn == 128 and stages == 4:
                        continue  # more shared memory than an SM has
                    yield (bm, bn, warps, stages)


def engine(args) -> dict:
    from nanoqwen import LLM
    from nanoqwen.bench.runs import latency_run, throughput_run

    runs = [(b, False) for b in (int(x) for x in args.block_sizes.split(","))]
    if flash_attn_available() and 256 in [b for b, _ in runs]:
        runs.append((256, True))
    results = []
    for block, flash in runs:
        hide = contextlib.nullcontext() if flash else flash_attn_hidden()
        with hide:
            llm = LLM(
                random_shape=args.shape,
                device="cuda",
                dtype="bfloat16",
                block_size=block,
                attention_backend="triton",
                max_num_seqs=256,
                max_num_batched_tokens=16384,
                progress=False,
            )
            assert (llm.runner.model.layers[0].self_attn.backend.flash is not None) == flash
            rng = random.Random(0)
            latency_run(llm, 1, 16, 8, rng)  # warm-up
            bs1 = latency_run(llm, 1, 128, 128, rng)
            long = latency_run(llm, 8, 2048, 4, rng)
            tput = throughput_run(llm, args.num_requests, 0)
        row = {
            "block_size": block,
            "flash_attn": flash,
            "output_tok_s": tput["output_tok_s"],
            "ttft_ms_p50": tput["ttft_ms_p50"],
            "tpot_ms_p50": tput["tpot_ms_p50"],
            "bs1_step_ms": bs1["step_ms_p50"],
            "ttft_8x2048_ms": long["ttft_ms"],
            "num_kv_blocks": llm.runner.kv.num_blocks,
        }
        print(json.dumps(row), flush=True)
        results.append(row)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\n{args.shape}, triton backend, {args.num_requests} requests")
    print("block | flash-attn | output tok/s | TTFT p50 ms | TPOT p50 ms | bs1 step ms | "
          "TTFT 8x2048 ms")  # fmt: skip
    for r in results:
        print(
            f"{r['block_size']} | {'yes' if r['flash_attn'] else 'no'} | {r['output_tok_s']:,.0f}"
            f" | {r['ttft_ms_p50']:.0f} | {r['tpot_ms_p50']:.2f} | {r['bs1_step_ms']:.3f}"
            f" | {r['ttft_8x2048_ms']:.1f}"
        )
    return {"shape": args.shape, "engine": results}


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--shapes", default="0.5B,7B")
    k.add_argument("--seqs", type=int, default=4)
    k.add_argument("--prompt-len", type=int, default=2048)
    k.add_argument("--sweep", action="store_true", help="time other tile configurations")
    e = sub.add_parser("engine")
    e.add_argument("--shape", default="0.5B")
    e.add_argument("--block-sizes", default=",".join(map(str, BLOCK_SIZES)))
    e.add_argument("--num-requests", type=int, default=256)
    for sp in (k, e):
        sp.add_argument("--json", dest="json_path")
    args = p.parse_args()
    result = kernels(args) if args.what == "kernels" else engine(args)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
