"""The HF transformers side of `nanoqwen bench --compare hf`, on nanoqwen's own weights."""

from __future__ import annotations

import random
import time

import torch

from nanoqwen.runtime.engine import LLM


@torch.no_grad()
def hf_model_from(llm: LLM):
    """An HF Qwen2ForCausalLM holding the same weights as llm (fused tensors split back)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = llm.config
    net = llm.runner.model
    hf_cfg = Qwen2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        eos_token_id=None,
        pad_token_id=0,
    )
    dtype, device = net.embed_tokens.dtype, net.embed_tokens.device
    with torch.device("meta"):
        hf = Qwen2ForCausalLM(hf_cfg)
    state = {"model.embed_tokens.weight": net.embed_tokens, "model.norm.weight": net.norm.weight}
    if not cfg.tie_word_embeddings:
        state["lm_head.weight"] = net.lm_head
    for i, layer in enumerate(net.layers):
        pre = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        for name, w, b in zip(
            ("q_proj", "k_proj", "v_proj"),
            attn.qkv_proj.weight.split(sizes),
            attn.qkv_proj.bias.split(sizes),
        ):
            state[f"{pre}self_attn.{name}.weight"] = w
            state[f"{pre}self_attn.{name}.bias"] = b
        state[f"{pre}self_attn.o_proj.weight"] = attn.o_proj.weight
        gate, up = mlp.gate_up_proj.weight.chunk(2)
        state[f"{pre}mlp.gate_proj.weight"] = gate
        state[f"{pre}mlp.up_proj.weight"] = up
        state[f"{pre}mlp.down_proj.weight"] = mlp.down_proj.weight
        state[f"{pre}input_layernorm.weight"] = layer.input_layernorm.weight
        state[f"{pre}post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    hf.load_state_dict({k: v.contiguous() for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    # RoPE's inv_freq (a non-persistent buffer, on meta so far) is built after the cast:
    # float32, as from_pretrained keeps it. Cast to bf16 with the model, it moved every
    # rotation angle by up to 0.4% in HF bf16 and float32 alike, and the fidelity test took
    # that for our error. (Built under a device context: transformers' versions differ on
    # a device argument.)
    rotary = type(hf.model.rotary_emb)
    hf.model.rotary_emb = torch.nn.Identity()
    hf = hf.to(device=device, dtype=dtype).eval()
    with torch.device(device):
        hf.model.rotary_emb = rotary(hf_cfg)
    return hf


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.no_grad()
def hf_latency(hf, bs: int, prompt_len: int, new_tokens: int, rng: random.Random) -> float:
    """End-to-end tok/s of HF generate (greedy, prefill included), as the anchors measure."""
    device = hf.model.embed_tokens.weight.device
    ids = torch.tensor(
        [[rng.randrange(10000) for _ in range(prompt_len)] for _ in range(bs)], device=device
    )
    warm = ids[:, :16]
    hf.generate(warm, attention_mask=torch.ones_like(warm), do_sample=False, max_new_tokens=2)
    kwargs = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    _sync()
    start = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    _sync()
    assert out.shape[1] == prompt_len + new_tokens
    return bs * new_tokens / (time.perf_counter() - start)


@torch.no_grad()
def hf_throughput(hf, prompts: list[list[int]], out_lens: list[int]) -> float:
    """Output tok/s of HF's continuous batching (generate_batch, paged attention).
    generate_batch takes one max_new_tokens for all requests, so each request gets the
    workload's mean output length; throughput is output tokens over wall time."""
    from transformers import GenerationConfig

    mean_out = round(sum(out_lens) / len(out_lens))
    config = GenerationConfig(
        max_new_tokens=mean_out, do_sample=True, temperature=0.6, eos_token_id=None, pad_token_id=0
    )
    hf.generate_batch(prompts[:4], generation_config=config, max_new_tokens=8)  # warm-up
    _sync()
    start = time.perf_counter()
    results = hf.generate_batch(prompts, generation_config=config)
    _sync()
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.generated_tokens) for r in results.values())
    return tokens / elapsed
