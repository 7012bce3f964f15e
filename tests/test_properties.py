"""Property tests (hypothesis): random values of every type thrown at SamplingParams,
LLM(...)'s arguments, config.json's fields, the CLI's flags and the checkpoint file. Each call
either works, with every value in range, or raises InvalidInputError (the CLI: exit 2) with a
one-line message; never another exception. Fixed seed and bounded examples, for CI."""

from __future__ import annotations

import io
import json
import math
import shutil
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from nanoqwen import LLM, InvalidInputError, SamplingParams
from nanoqwen.cli import main

SETTINGS = dict(
    derandomize=True,  # the same examples on every run
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# Values of every type a caller might pass by mistake (and some right ones).
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-10, 40),
    st.integers(min_value=2**62),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.binary(max_size=4),
    st.lists(st.one_of(st.integers(-3, 600), st.text(max_size=3), st.floats()), max_size=3),
    st.tuples(st.integers(0, 600)),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def assert_one_line(error: InvalidInputError, *names: str) -> None:
    message = str(error)
    assert message and "\n" not in message and len(message) < 400, message
    if names:
        assert message.startswith(names), message


# ---- SamplingParams ----------------------------------------------------------------------------
FIELDS = [
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
    "seed", "logprobs", "prompt_logprobs",
]  # fmt: skip


def assert_in_range(p: SamplingParams) -> None:
    floats = (p.temperature, p.top_p, p.min_p, p.repetition_penalty)
    assert all(type(v) is float and math.isfinite(v) for v in floats)
    assert p.temperature >= 0 and 0 < p.top_p <= 1 and 0 <= p.min_p <= 1
    assert p.repetition_penalty > 0
    assert -2 <= p.presence_penalty <= 2 and -2 <= p.frequency_penalty <= 2
    ints = (p.top_k, p.max_tokens, p.min_tokens)
    assert all(type(v) is int for v in ints)
    assert (p.top_k == -1 or p.top_k >= 1) and 0 <= p.min_tokens <= p.max_tokens
    assert p.seed is None or (type(p.seed) is int and 0 <= p.seed < 2**63)
    for n in (p.logprobs, p.prompt_logprobs):
        assert n is None or (type(n) is int and 0 <= n <= 20)
    assert type(p.ignore_eos) is bool
    assert all(type(s) is str and s for s in p.stop_strings)
    assert all(type(t) is int and t >= 0 for t in p.stop_token_ids)


# Half of the values are of the right type and mostly in range, so both outcomes are common.
PLAUSIBLE = st.one_of(st.floats(-0.5, 2.5), st.integers(-2, 30), st.lists(st.integers(-1, 9)))


@settings(max_examples=400, **SETTINGS)
@given(st.dictionaries(st.sampled_from(FIELDS), st.one_of(PLAUSIBLE, JUNK), max_size=3))
def test_sampling_params_work_or_refuse_in_one_line(kwargs):
    try:
        params = SamplingParams(**kwargs)
    except InvalidInputError as e:
        assert_one_line(e, *(f"{name}=" for name in kwargs))
        assert e.param in kwargs
        event("refused")
        return
    event("works")
    assert_in_range(params)
    assert SamplingParams.from_dict(kwargs) == params


# ---- LLM(...) ----------------------------------------------------------------------------------
SMALL_JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.floats(), st.text(max_size=4), st.lists(
        st.integers(), max_size=2)
)  # fmt: skip
ENGINE_ARGS = {
    # valid values small enough that a tiny model loads fast, or anything else
    "device": st.one_of(st.sampled_from(["cpu", "cpu:0", "cuda", "meta", "tpu", ""]), SMALL_JUNK),
    "dtype": st.one_of(st.sampled_from(["auto", "float32", "bfloat16", "int8"]), SMALL_JUNK),
    "block_size": st.one_of(st.sampled_from([1, 16, 64, 3, 0, -16]), SMALL_JUNK),
    "num_kv_blocks": st.one_of(st.integers(-2, 40), st.floats(), st.text(max_size=3)),
    "max_num_seqs": st.one_of(st.integers(-2, 1000), SMALL_JUNK),
    "max_num_batched_tokens": st.one_of(st.integers(-2, 10_000), SMALL_JUNK),
    "max_model_len": st.one_of(st.integers(-5, 3000), SMALL_JUNK),
    "attention_backend": st.one_of(st.sampled_from(["auto", "torch", "triton", "x"]), SMALL_JUNK),
    "enforce_eager": SMALL_JUNK,
    "gpu_memory_utilization": st.one_of(st.floats(-1, 2), SMALL_JUNK),
    "progress": st.one_of(st.just(False), SMALL_JUNK),
}


@pytest.mark.filterwarnings("ignore")
@settings(max_examples=40, **SETTINGS)
@given(st.fixed_dictionaries({}, optional=ENGINE_ARGS))
def test_engine_arguments_work_or_refuse_in_one_line(tiny_model, kwargs):
    args = dict(num_kv_blocks=8, block_size=16, progress=False) | kwargs
    try:
        llm = LLM(str(tiny_model[0]), **args)
    except InvalidInputError as e:
        assert_one_line(e)
        assert e.param in args, str(e)
        event("refused")
        return
    event("works")
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    assert len(out.token_ids) == min(2, llm.max_model_len - 1)


# ---- config.json -------------------------------------------------------------------------------
CONFIG_FIELDS = [
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "max_position_embeddings", "tie_word_embeddings", "eos_token_id", "architectures",
    "model_type", "rope_scaling", "rope_parameters", "use_sliding_window",
]  # fmt: skip
MISSING = object()


@settings(max_examples=50, **SETTINGS)
@given(
    st.sampled_from(CONFIG_FIELDS),
    st.one_of(st.just(MISSING), st.integers(-3, 300), SMALL_JUNK, st.dictionaries(
        st.sampled_from(["rope_type", "type", "rope_theta", "factor"]),
        st.one_of(st.text(max_size=6), st.floats(0, 10)), max_size=2)),
)  # fmt: skip
def test_config_fields_work_or_refuse_in_one_line(tiny_model, field, value):
    src = tiny_model[0]
    raw = json.loads((src / "config.json").read_text())
    if value is MISSING:
        raw.pop(field, None)
    else:
        raw[field] = value
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        for f in src.iterdir():
            if f.name != "config.json":
                (path / f.name).symlink_to(f)
        (path / "config.json").write_text(json.dumps(raw))
        try:
            llm = LLM(str(path), num_kv_blocks=8, block_size=16, progress=False)
        except InvalidInputError as e:
            assert_one_line(e)
            event("refused")
            return
        event("works")
        out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        assert len(out[0].token_ids) == 2


# ---- checkpoint files --------------------------------------------------------------------------
@settings(max_examples=30, **SETTINGS)
@given(st.data())
def test_corrupted_weights_load_or_refuse_in_one_line(tiny_model, data):
    src = tiny_model[0]
    blob = bytearray((src / "model.safetensors").read_bytes())
    header = 8 + int.from_bytes(blob[:8], "little")
    kind = data.draw(st.sampled_from(["truncate", "flip", "zero", "append"]))
    if kind == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif kind == "flip":  # bytes of the header: its length, its JSON, or the first tensor
        for _ in range(data.draw(st.integers(1, 4))):
            blob[data.draw(st.integers(0, header + 16))] = data.draw(st.integers(0, 255))
    elif kind == "zero":
        start = data.draw(st.integers(0, header))
        blob[start : start + data.draw(st.integers(1, 64))] = bytes(64)[: len(blob) - start]
    else:
        blob += data.draw(st.binary(min_size=1, max_size=16))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        shutil.copytree(src, path, ignore=shutil.ignore_patterns("*.safetensors"))
        (path / "model.safetensors").write_bytes(bytes(blob))
        try:
            LLM(str(path), num_kv_blocks=4, block_size=16, progress=False)
            event("works")
        except InvalidInputError as e:
            assert_one_line(e)
            event("refused")


# ---- CLI flags ---------------------------------------------------------------------------------
FLAGS = [
    "--temperature", "--top-p", "--top-k", "--min-p", "--min-tokens", "--repetition-penalty",
    "--presence-penalty", "--frequency-penalty", "--max-tokens", "--seed", "--stop",
    "--stop-token-ids", "--block-size", "--num-kv-blocks", "--max-model-len", "--max-num-seqs",
    "--max-num-batched-tokens", "--gpu-memory-utilization", "--dtype", "--device",
    "--attention-backend", "--format",
]  # fmt: skip
# No digit strings from st.text: a --num-kv-blocks of 10**6 would be a valid, huge allocation.
FLAG_VALUES = st.one_of(
    st.integers(-5, 300).map(str),
    st.floats().map(str),
    st.text(st.characters(blacklist_categories=("Nd", "Cs")), max_size=6),
    st.sampled_from(["", "-1", "0", "1e9", "nan", "inf", "1,2", "auto", "cuda", "bfloat16"]),
)
BASE = [
    "--device", "cpu", "--temperature", "0", "--repetition-penalty", "1", "--max-tokens", "3",
    "--block-size", "16",
]  # fmt: skip
BASE += ["--num-kv-blocks", "16", "--max-model-len", "48", "-q", "--no-chat"]


@settings(max_examples=60, **SETTINGS)
@given(st.sampled_from(FLAGS), FLAG_VALUES)
def test_cli_flags_work_or_exit_2_with_one_line(tiny_model, monkeypatch, flag, value):
    monkeypatch.delenv("NANOQWEN_DEBUG", raising=False)
    argv = ["generate", "--model", str(tiny_model[0]), *BASE, f"{flag}={value}", "Hello world"]
    out, err, saved = io.StringIO(), io.StringIO(), sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(b""), encoding="utf-8")
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = main(argv)
    finally:
        sys.stdin = saved
    lines = err.getvalue().splitlines()
    event(f"exit {code}")
    if code == 0:
        assert lines == [] and out.getvalue().endswith("\n")
    else:
        assert code == 2, err.getvalue()
        assert len(lines) == 1 and lines[0].startswith("nanoqwen: error: "), err.getvalue()
        assert out.getvalue() == ""
