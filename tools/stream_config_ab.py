"""The streamed GEMV's launch settings (kernels/triton/stream_gemv.py) tried in the whole
batch-1 decode step: for each setting the batch-1 graph is captured again and replayed (CUDA
events), the settings taking turns for --rounds rounds in one process, so that each
setting's figure is comparable with the others'. Random weights of a real shape.

A setting is `name` (the defaults) or `name:proj=rows,splits,stages,ahead;...` over the
projections qkv, o, gate_up, down and lm_head, each optionally followed by other
StreamGemvConfig fields as `,field:value` (integers); a projection it does not name keeps
its default. With --quantization int4 a projection's values are the tensor-core GEMV's
(kernels/triton/quant_gemv_mma.py): `proj=rows,panels,stages,splits` and optionally
`,max_registers:N`. An item `@module.NAME=value` sets a constant of a module under
nanoqwen.kernels.triton for that setting (an integer), e.g. `@decode_attention.SMALL_TILE=64`.

Usage (device): python3 tools/stream_config_ab.py --shape 7B \\
    'default|st3:qkv=16,2,3,2;gate_up=16,1,3,2|ahead1:qkv=16,2,4,1'
  python3 tools/stream_config_ab.py --shape 7B --quantization int4 'default|d2:down=16,8,3,2'
  python3 tools/stream_config_ab.py --shape 0.5B 'default|t64:@decode_attention.SMALL_TILE=64'
"""

from __future__ import annotations

import argparse
import importlib

import torch
from profile_decode import replay_ms

from nanoqwen import LLM, SamplingParams
from nanoqwen.kernels.triton import quant_gemv_mma as qm
from nanoqwen.kernels.triton import stream_gemv as sg


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """(n, k) as stream_gemv_config sees each projection (gate_up: the gate rows)."""
    hidden, inter, head = config.hidden_size, config.intermediate_size, config.head_dim
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    return {
        "qkv": ((heads + 2 * kv) * head, hidden),
        "o": (hidden, heads * head),
        "gate_up": (inter, hidden),
        "down": (hidden, inter),
        "lm_head": (config.vocab_size, hidden),
    }


def int4_shapes(config) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) as mma_gemv_config sees each projection (gate_up: gate
    and up rows)."""
    shapes = projection_shapes(config)
    shapes["gate_up"] = (2 * shapes["gate_up"][0], shapes["gate_up"][1])
    return shapes


def _config(values: str, int4: bool):
    a, b, c, d, *extra = values.split(",")
    a, b, c, d = int(a), int(b), int(c), int(d)
    fields = {k: int(v) for k, v in (x.split(":") for x in extra)}
    if int4:
        return qm.MmaGemvConfig(rows=a, panels=b, num_stages=c, splits=d, **fields)
    return sg.StreamGemvConfig(rows=a, splits=b, num_stages=c, ahead=d, **fields)


def parse(spec: str, shapes: dict[str, tuple[int, int]], int4: bool = False):
    """[(name, {shape: config}, {(module, NAME): value})] in the order given."""
    settings = []
    for item in filter(None, (x.strip() for x in spec.split("|"))):
        name, _, body = item.partition(":")
        chosen, constants = {}, {}
        for part in filter(None, body.split(";")):
            key, value = part.split("=")
            if key.startswith("@"):
                module, _, attr = key[1:].rpartition(".")
                mod = importlib.import_module(f"nanoqwen.kernels.triton.{module}")
                if not hasattr(mod, attr):
                    raise SystemExit(f"{module} has no {attr}")
                constants[(mod, attr)] = int(value)
            else:
                chosen[shapes[key]] = _config(value, int4)
        settings.append((name, chosen, constants))
    return settings


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("settings")
    p.add_argument("--shape", default="7B")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--quantization", default="none", choices=["none", "int4"])
    args = p.parse_args()
    llm = LLM(random_shape=args.shape, device="cuda", dtype="bfloat16", max_num_seqs=4,
              num_kv_blocks=64, progress=False, quantization=args.quantization)  # fmt: skip
    int4 = args.quantization == "int4"
    shapes = int4_shapes(llm.config) if int4 else projection_shapes(llm.config)
    settings = parse(args.settings, shapes, int4)
    greedy = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    llm._add([7] * args.prompt_len, greedy, False)
    while llm.scheduler.waiting:
        llm.step()
    for _ in range(5):
        llm.step()
    graphs = llm.runner.graphs
    key = graphs.key_for(1, args.prompt_len + 6, llm.runner.sampler.filtering)
    default = sg.stream_gemv_config
    default_int4 = qm.mma_gemv_config
    defaults = {const: getattr(*const) for _, _, constants in settings for const in constants}
    times: dict[str, list[float]] = {name: [] for name, _, _ in settings}
    first = None  # the first setting's logits, which the others' are checked against
    for r in range(args.rounds):
        for name, chosen, constants in settings:
            sg.stream_gemv_config = lambda n, k, c=chosen: c.get((n, k)) or default(n, k)
            qm.mma_gemv_config = lambda n, k, c=chosen: c.get((n, k)) or default_int4(n, k)
            for (mod, attr), value in {**defaults, **constants}.items():
                setattr(mod, attr, value)
            with torch.inference_mode():
                graphs._capture(key)
            graph, logits, _ = graphs.graphs[key]
            times[name].append(replay_ms(graph, 300))
            logits = logits.float().clone()
            first = logits if first is None else first
            gap = (logits - first).abs().max().item()
            same = logits.argmax(-1).equal(first.argmax(-1))
            print(f"round {r} {name}: {times[name][-1]:.4f} ms (logits max |diff| {gap:.3g} "
                  f"against {settings[0][0]}, argmax {'same' if same else 'DIFFERS'})",
                  flush=True)  # fmt: skip
    sg.stream_gemv_config = default
    qm.mma_gemv_config = default_int4
    for name, t in times.items():
        print(f"{name:>12}: " + " / ".join(f"{x:.4f}" for x in t) + f"  (min {min(t):.4f} ms)")


if __name__ == "__main__":
    main()
