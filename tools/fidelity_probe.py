#!/usr/bin/env python3
"""How far nanoqwen's and HF's bf16 logits each lie from the float32 model (HF in float32, the
same weights), per attention setup: the yardstick for the bf16 fidelity test's thresholds.
HF is measured three ways (sdpa prefill, eager prefill, its decode): how far HF's own bf16
variants spread is the noise a random-weight model amplifies from one-ulp differences.

    python3 tools/fidelity_probe.py --shape 1.5B     # on a GPU, flash-attn wheel installed
    python3 tools/fidelity_probe.py --shape 1.5B     # on a CPU: the torch backend, bf16
    python3 tools/fidelity_probe.py --shape 1.5B --prompts 16   # 768 positions: stable means
    FIDELITY_UNFUSED=RMSNorm,MLP python3 tools/fidelity_probe.py   # torch ops, not Triton
    FIDELITY_BACKEND=torch FIDELITY_SPLIT=qkv,gate_up ...   # torch attention, HF's GEMMs
    python3 tools/fidelity_probe.py --lens   # where in the layers ours departs from HF
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import random
import sys

import torch
import torch.nn.functional as F

from nanoqwen import LLM
from nanoqwen.bench.hf import hf_model_from

NEW = 48
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gap_stats(test: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(|logprob gap| at the reference's argmax per position, argmax flips, flips where the
    reference margin exceeds 0.1)."""
    lt, lr = test.log_softmax(-1), ref.log_softmax(-1)
    tok = ref.argmax(-1, keepdim=True)
    gap = (lt.gather(1, tok) - lr.gather(1, tok)).abs().squeeze(1).cpu()
    top2 = ref.topk(2).values
    margin = top2[:, 0] - top2[:, 1]
    flips = test.argmax(-1) != tok.squeeze(1)
    return gap, int(flips.sum()), int((flips & (margin > 0.1)).sum())


def _models(shape: str, block_size: int, flash: bool):
    """Our bf16 engine on random weights of the shape, HF on them in bf16 and in float32."""
    if not flash:
        sys.modules["flash_attn"] = None
    llm = LLM(
        random_shape=shape,
        device=DEVICE,
        dtype="bfloat16",
        block_size=block_size,
        num_kv_blocks=64 * 256 // block_size,
        max_num_seqs=8,
        progress=False,
        attention_backend=os.environ.get("FIDELITY_BACKEND", "auto"),
    )
    hf = hf_model_from(llm)
    # FIDELITY_UNFUSED=RMSNorm,MLP: those modules in plain torch ops instead of their Triton
    # kernels (a bisection of where ours departs from HF on the GPU)
    unfused = os.environ.get("FIDELITY_UNFUSED", "").split(",")
    for module in llm.runner.model.modules():
        if type(module).__name__ in unfused:
            module.ops = dataclasses.replace(module.ops, add_rms_norm=None, silu_mul=None)
    # FIDELITY_SPLIT=qkv,gate_up: HF's separate projections (one GEMM each) for our fused ones
    split = os.environ.get("FIDELITY_SPLIT", "").split(",")
    cfg = llm.config
    for layer in llm.runner.model.layers:
        if "qkv" in split:
            _split(layer.self_attn.qkv_proj, [cfg.q_size, cfg.kv_size, cfg.kv_size])
        if "gate_up" in split:
            _split(layer.mlp.gate_up_proj, [cfg.intermediate_size] * 2)
    return llm, hf, copy.deepcopy(hf).float()


def _split(linear, sizes: list[int]) -> None:
    weights = [w.contiguous() for w in linear.weight.split(sizes)]
    biases = [None] * len(sizes) if linear.bias is None else linear.bias.split(sizes)

    def forward(x):
        return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1)

    linear.forward = forward


def _rope_tables(llm, hf) -> str:
    """Our RoPE tables (as the kernels read them, rounded to bf16) against HF's rotary output."""
    pos = torch.arange(4096, device=DEVICE)
    x = torch.zeros(1, dtype=torch.bfloat16, device=DEVICE)
    cos, sin = hf.model.rotary_emb(x, pos[None])
    rotary = llm.runner.model.rotary
    half = cos.shape[-1] // 2
    ours = [rotary.cos_half[pos].to(torch.bfloat16), rotary.sin_half[pos].to(torch.bfloat16)]
    diff = [(o != t[0, :, :half]).float().mean().item() for o, t in zip(ours, (cos, sin))]
    return (
        f"RoPE tables (positions < 4096) differing from HF's: cos {diff[0]:.2%}, sin {diff[1]:.2%}"
    )


def _random_prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(10000) for _ in range(rng.randint(8, 200))]


def _greedy(hf, prompt: list[int], **kwargs):
    """HF's greedy continuation of prompt by NEW tokens."""
    ids = torch.tensor([prompt], device=DEVICE)
    return hf.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False,
        max_new_tokens=NEW, min_new_tokens=NEW, **kwargs,
    )  # fmt: skip


def _eager(hf):
    """A copy of the bf16 HF model with its eager attention instead of SDPA."""
    eager = copy.deepcopy(hf)
    eager.config._attn_implementation = "eager"
    for layer in eager.model.layers:
        layer.self_attn.config._attn_implementation = "eager"
    return eager


@torch.no_grad()
def probe(shape: str, block_size: int, flash: bool, prompts: int = 4) -> None:
    llm, hf, hf32 = _models(shape, block_size, flash)
    hf_eager = _eager(hf)
    rng = random.Random(1)
    rows: dict[str, list] = {}
    for _ in range(prompts):
        prompt = _random_prompt(rng)
        out = _greedy(hf, prompt, output_logits=True, return_dict_in_generate=True)
        seq = out.sequences[:, :-1]
        tail = slice(len(prompt) - 1, None)
        logits = {
            "ours": llm.runner.prompt_logits(seq[0].tolist(), last=NEW),
            "hf bf16 prefill": hf(seq).logits[0, tail].float(),
            "hf bf16 eager": hf_eager(seq).logits[0, tail].float(),
            "hf bf16 decode": torch.cat(out.logits).float(),
        }
        ref = hf32(seq).logits[0, tail].float()
        for who, x in logits.items():
            rows.setdefault(f"{who} vs fp32", []).append(gap_stats(x, ref))
            if who != "hf bf16 prefill":  # how far each lies from HF's own bf16 prefill
                pair = f"{who} vs hf prefill"
                rows.setdefault(pair, []).append(gap_stats(x, logits["hf bf16 prefill"]))
    name = f"{shape} block{block_size} {'flash-attn' if flash else 'no-flash-attn'}"
    for who, stats in rows.items():
        gaps = torch.cat([s[0] for s in stats])
        print(
            f"{name:30s} {who:26s} gap: mean {gaps.mean():.4f} "
            f"p95 {gaps.quantile(0.95):.4f} max {gaps.max():.4f}  "
            f"flips {sum(s[1] for s in stats)}/{prompts * NEW}  "
            f"clear flips {sum(s[2] for s in stats)}"
        )
    del llm, hf, hf32, hf_eager
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    sys.modules.pop("flash_attn", None)


def _capture(modules, store: dict, tag: str) -> list:
    """Forward hooks that keep each module's first output tensor (float32) under (tag, i)."""

    def hook(i):
        def fn(_mod, _inp, out):
            t = out[0] if isinstance(out, tuple) else out
            if (
                tag.endswith("layer")
                and isinstance(out, tuple)
                and out[1] is not None
                and t.dim() == 2
            ):
                t = out[0].float() + out[1].float()  # ours: (layer output, residual) -> the stream
            store[(tag, i)] = t.detach().float().reshape(-1, t.shape[-1])

        return fn

    return [m.register_forward_hook(hook(i)) for i, m in enumerate(modules)]


@torch.no_grad()
def layers(shape: str, block_size: int, flash: bool) -> None:
    """Relative error against float32 HF, per layer and sub-block, for ours and HF bf16."""
    llm, hf, hf32 = _models(shape, block_size, flash)
    prompt = [random.Random(3).randrange(10000) for _ in range(240)]
    runs = {}
    for who, model, blocks in (
        ("ours", None, llm.runner.model.layers),
        ("hf", hf, hf.model.layers),
        ("fp32", hf32, hf32.model.layers),
    ):
        store = {}
        hooks = []
        hooks += _capture([b.self_attn for b in blocks], store, "attn")
        hooks += _capture([b.mlp for b in blocks], store, "mlp")
        hooks += _capture(list(blocks), store, "layer" if who != "ours" else "ours-layer")
        if model is None:
            llm.runner.prompt_logits(prompt, last=1)
        else:
            model(torch.tensor([prompt], device=DEVICE))
        for h in hooks:
            h.remove()
        runs[who] = {(k[0].replace("ours-", ""), k[1]): v for k, v in store.items()}

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    print(f"{shape} block{block_size} flash={flash}: relative error vs float32 HF")
    print("layer | attn ours | attn hf | mlp ours | mlp hf | stream ours | stream hf")
    for i in range(len(hf.model.layers)):
        ref = runs["fp32"]
        row = [i]
        for tag in ("attn", "mlp", "layer"):
            row += [
                rel(runs["ours"][(tag, i)], ref[(tag, i)]),
                rel(runs["hf"][(tag, i)], ref[(tag, i)]),
            ]
        print(" | ".join(f"{x:.5f}" if isinstance(x, float) else str(x) for x in row))
    del llm, hf, hf32
    sys.modules.pop("flash_attn", None)


def _stream_hooks(norms, store: list, ours: bool) -> list:
    """Pre-hooks on RMSNorms that keep the residual stream each one reads (ours hand the
    norm (x, residual) to add; HF hands it the stream itself)."""

    def fn(_mod, args):
        x = args[0]
        if ours and len(args) > 1 and args[1] is not None:
            x = args[1] + x  # the norm's own bf16 add
        # a copy: ours adds the next residual into this buffer in place
        store.append(x.detach().reshape(-1, x.shape[-1]).clone())

    return [n.register_forward_pre_hook(fn) for n in norms]


def _norms(model) -> list:
    """The RMSNorms in the order the forward calls them: each layer's two, then the final."""
    return [n for b in model.layers for n in (b.input_layernorm, b.post_attention_layernorm)] + [
        model.norm
    ]


@torch.no_grad()
def lens(shape: str, block_size: int, flash: bool, prompts: int) -> None:
    """Where ours departs: the residual stream before every norm, ours and HF bf16, each
    through the float32 final norm and lm_head, against the float32 model's stream at the
    same point (a logit lens); then the final stream of each body through the other's head."""
    llm, hf, hf32 = _models(shape, block_size, flash)

    def head32(x):
        return hf32.lm_head(hf32.model.norm(x.float()))

    print(_rope_tables(llm, hf))
    rng = random.Random(1)
    gaps: dict[str, list] = {}
    for _ in range(prompts):
        prompt = _random_prompt(rng)
        seq = _greedy(hf, prompt)[:, :-1]
        streams = {}
        for who, model in (("ours", llm.runner.model), ("hf", hf.model), ("fp32", hf32.model)):
            store: list = []
            hooks = _stream_hooks(_norms(model), store, who == "ours")
            if who == "ours":
                logits = llm.runner.prompt_logits(seq[0].tolist(), last=NEW)
            else:
                logits = (hf if who == "hf" else hf32)(seq).logits[0, -NEW:].float()
            for h in hooks:
                h.remove()
            streams[who] = ([t[-NEW:] for t in store], logits)
        ref_streams, ref = streams["fp32"]
        for who in ("ours", "hf"):
            for i, (x, r) in enumerate(zip(streams[who][0], ref_streams, strict=True)):
                gaps.setdefault((who, i), []).append(gap_stats(head32(x), head32(r))[0])
        ours_final, hf_final = streams["ours"][0][-1], streams["hf"][0][-1]
        swaps = {
            "ours body, ours head": streams["ours"][1],
            "ours body, hf head": hf.lm_head(hf.model.norm(ours_final)).float(),
            "hf body, ours head": llm.runner.model.compute_logits(
                (hf_final, torch.zeros_like(hf_final))
            ),
            "hf body, hf head": streams["hf"][1],
        }
        for name, x in swaps.items():
            gaps.setdefault(name, []).append(gap_stats(x, ref)[0])
    print(
        f"{shape} block{block_size} flash={flash}: mean |logprob gap| vs float32, {prompts} "
        "prompts; stream points through the float32 head (in_i: before layer i's attention, "
        "mid_i: before its MLP)"
    )
    points = len(_norms(hf.model))
    for i in range(points):
        name = "final" if i == points - 1 else f"{'in' if i % 2 == 0 else 'mid'}_{i // 2}"
        o, h = (torch.cat(gaps[(w, i)]).mean().item() for w in ("ours", "hf"))
        print(f"  {name:8s} ours {o:.4f}  hf {h:.4f}  ratio {o / max(h, 1e-9):.2f}")
    for name in (
        "ours body, ours head",
        "ours body, hf head",
        "hf body, ours head",
        "hf body, hf head",
    ):
        print(f"  {name:22s} {torch.cat(gaps[name]).mean().item():.4f}")
    del llm, hf  # hf32 too, on return (head32 holds it)
    sys.modules.pop("flash_attn", None)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1.5B")
    ap.add_argument("--layers", action="store_true", help="per-layer errors instead")
    ap.add_argument("--lens", action="store_true", help="logit lens over the stream, swaps")
    ap.add_argument("--prompts", type=int, default=4, help="the fidelity test's 4 by default")
    args = ap.parse_args()
    if args.lens:
        lens(args.shape, 256, True, args.prompts)
        lens(args.shape, 16, False, args.prompts)
    elif args.layers:
        layers(args.shape, 256, True)
        layers(args.shape, 16, False)
    else:
        probe(args.shape, 256, True, args.prompts)
        probe(args.shape, 16, False, args.prompts)
