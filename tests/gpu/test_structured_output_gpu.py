"""Structured output, tool calls and logit bias on the GPU (bfloat16; CUDA graphs, logits-only
for constrained or biased steps): constrained answers are their grammar's sentences, a free
request beside constrained ones keeps its tokens, forced tool calls are valid, a bias of
+100 forces its token, and none of these steps syncs with the host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import launch_two_steps_without_host_sync

from nanoqwen import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

TEMPLATE = Path(__file__).parent.parent / "runtime" / "qwen25_chat_template.jinja"
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["color", "n", "tags"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"key": {"enum": ["x", "y"]}},
                       "required": ["key"], "additionalProperties": False},
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from conftest import write_tiny_model

    path = tmp_path_factory.mktemp("gpu-structured")
    write_tiny_model(path, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, intermediate_size=512, num_hidden_layers=3)  # fmt: skip
    # The Triton backend: the torch one reads prefill lengths back to the host.
    llm = LLM(str(path), device="cuda", dtype="bfloat16", num_kv_blocks=64, block_size=16,
              attention_backend="triton", progress=False)  # fmt: skip
    llm.tokenizer.set_chat_template(TEMPLATE.read_text(), "Qwen2.5's chat template")
    return llm


def test_constrained_and_free_requests_share_a_batch(llm):
    """A free request's greedy tokens beside constrained neighbours are those it has beside
    free ones living as long (in bfloat16 the batch's size may move its numerics)."""
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[7, 8, 9]] + [[5 + s, 9] for s in range(6)]
    # Records for ever: no constrained neighbour ends before max_tokens, as free ones don't.
    endless = {"type": "array", "minItems": 1000, "items": SCHEMA}
    neighbours = [
        SamplingParams(temperature=1.0, max_tokens=60, seed=s, ignore_eos=True) for s in range(6)
    ]
    constrained = [
        SamplingParams(temperature=1.0, max_tokens=60, seed=s, structured_output={"json": endless})
        for s in range(6)
    ]
    beside_free = llm.generate(prompts, [free, *neighbours])[0].token_ids
    outs = llm.generate(prompts, [free, *constrained])
    assert outs[0].token_ids == beside_free
    for out in outs[1:]:
        assert out.finish_reason == "length" and out.text.startswith("[{")
    documents = [SamplingParams(temperature=1.0, max_tokens=80, seed=s,
                                structured_output={"json": SCHEMA}) for s in range(6)]  # fmt: skip
    for out in llm.generate(prompts[1:], documents):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_a_required_tool_call_is_valid(llm):
    ask = [{"role": "user", "content": "look it up"}]
    params = [SamplingParams(temperature=1.0, max_tokens=80, seed=s) for s in range(4)]
    outs = llm.chat([ask] * 4, params, tools=[TOOL], tool_choice="required",
                    parallel_tool_calls=False)  # fmt: skip
    for out in outs:
        assert out.finish_reason == "tool_calls", out.output.text
        (call,) = out.tool_calls
        jsonschema.validate(json.loads(call.arguments), TOOL["function"]["parameters"])


def test_constrained_steps_have_no_host_sync(llm):
    """A constrained prefill and the decode step after it (a logits-only graph, its token in
    flight), each with its masks sent and its tokens sampled."""
    prompts = [[5, 9], [6, 9, 9], [7]]
    params = [
        SamplingParams(temperature=1.0, max_tokens=40, seed=s, structured_output={"json": SCHEMA})
        for s in range(3)
    ]
    llm.generate(prompts, params)  # captures the logits-only graphs these batches replay
    seqs = [llm._add(p, sp, False) for p, sp in zip(prompts, params)]
    prefill = llm.scheduler.schedule()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        one = llm._launch(prefill)
        one.complete()
        two = llm._launch(llm.scheduler.schedule())
        two.complete()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    one.result(), two.result()
    llm.abort(seqs)


def test_logit_bias_on_the_gpu(llm):
    """A biased request (a logits-only graph, then the scatter and the sampler) beside free
    ones, and no host sync in its step."""
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    forced = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={42: 100})
    outs = llm.generate([[7, 8, 9], [5, 6]], [free, forced])
    assert outs[1].token_ids == [42] * 12
    seqs = [llm._add(p, forced, False) for p in ([5, 6], [7, 8, 9])]
    launch_two_steps_without_host_sync(llm, llm.scheduler.schedule())
    llm.abort(seqs)
