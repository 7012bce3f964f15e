"""Bad input to LLM(...), generate() and stream(): one InvalidInputError line naming the
parameter, the value and what is allowed, and no request left behind. Each case here was a
traceback, a silently accepted value or a wrong result before the validation layer."""

from __future__ import annotations

from dataclasses import fields

import pytest
from conftest import readme_signature

from nanoqwen import LLM, InvalidInputError, SamplingParams
from nanoqwen.runtime.config import EngineConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model[0]), num_kv_blocks=16, block_size=16, progress=False)


def refusal(call, *args, **kwargs) -> InvalidInputError:
    with pytest.raises(InvalidInputError) as info:
        call(*args, **kwargs)
    assert "\n" not in str(info.value)
    return info.value


def assert_idle(llm: LLM) -> None:
    sched = llm.scheduler
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks
    assert not sched.waiting and not sched.running and not llm.output_processor.detokenizers


# ---- LLM(...) arguments ----------------------------------------------------------------------
def test_engine_defaults_are_the_ones_the_readme_documents():
    assert readme_signature("EngineConfig") == {f.name: f.default for f in fields(EngineConfig)}


def test_llm_takes_every_engine_setting_by_name():
    llm = LLM(None, random_shape="0.5B", device="cpu", num_kv_blocks=3, block_size=16,
              progress=False, max_num_seqs=2, swap_space=0)  # fmt: skip
    assert llm.engine_config == EngineConfig(
        random_shape="0.5B", num_kv_blocks=3, block_size=16, progress=False, max_num_seqs=2,
        swap_space=0,
    )  # fmt: skip
    base = EngineConfig(random_shape="0.5B", num_kv_blocks=3, block_size=16, progress=False)
    assert LLM(config=base, max_num_seqs=2).engine_config.max_num_seqs == 2
    error = refusal(LLM, None, blocksize=16)
    assert str(error).startswith("unknown engine option 'blocksize': allowed attention_backend")


ENGINE_ARGS = [
    # max_model_len=-5 was accepted (then every prompt failed, "allowed at most -6"), 0 ignored
    (dict(max_model_len=-5), "max_model_len=-5 is out of range: allowed None or an integer >= 2"),
    (dict(max_model_len=0), "max_model_len=0 is out of range: allowed None or an integer >= 2"),
    (dict(max_model_len=1.5), "max_model_len=1.5 is not an integer"),
    (dict(block_size=3), "block_size=3 is out of range: allowed a power of two from 1 to 65536"),
    (dict(block_size="16"), "block_size='16' is not an integer"),
    (dict(num_kv_blocks=0), "num_kv_blocks=0 is out of range: allowed None or an integer >= 1"),
    (dict(max_num_seqs=0), "max_num_seqs=0 is out of range: allowed an integer >= 1"),
    (dict(max_num_batched_tokens=True), "max_num_batched_tokens=True is not an integer"),
    (dict(gpu_memory_utilization=0), "gpu_memory_utilization=0 is out of range"),
    (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization='0.5' is not a number"),
    (dict(dtype="int8"), "dtype='int8' is unknown: allowed auto, float32, bfloat16, float16"),
    (dict(dtype=None), "dtype=None is not a string"),
    (dict(device=0), "device=0 is not a string: allowed auto, cpu, cuda, cuda:N"),
    (dict(device="meta"), "device='meta' is not supported: allowed auto, cpu, cuda, cuda:N"),
    (dict(device="tpu"), "device='tpu' is unknown: allowed auto, cpu, cuda, cuda:N"),
    (dict(device="gpu!"), "device='gpu!' is unknown: allowed auto, cpu, cuda, cuda:N"),
    (dict(attention_backend="flash"), "attention_backend='flash' is unknown"),
    (dict(attention_backend="triton"), "attention_backend='triton' is unavailable"),
    (dict(enforce_eager="no"), "enforce_eager='no' is not a bool: allowed True or False"),
    (dict(progress=None), "progress=None is not a bool"),
    (dict(model=3), "model=3 is not a path"),
    # Longer than the model or the KV pool: refused instead of silently cut.
    (dict(max_model_len=4096), "max_model_len=4096 is too long: allowed at most 256, what the"),
]


@pytest.mark.parametrize(("kwargs", "message"), ENGINE_ARGS)
def test_bad_engine_arguments_are_refused(tiny_model, kwargs, message):
    args = dict(model=str(tiny_model[0]), num_kv_blocks=16, block_size=16, progress=False)
    error = refusal(LLM, **(args | kwargs))
    assert str(error).startswith(message), str(error)
    assert error.param == next(iter(kwargs))


def test_max_model_len_is_kept_when_it_fits(tiny_model):
    llm = LLM(
        str(tiny_model[0]), num_kv_blocks=16, block_size=16, max_model_len=100, progress=False
    )
    assert llm.max_model_len == 100
    error = refusal(llm.generate, [[1] * 100], GREEDY)
    assert str(error) == "prompt has 100 tokens: allowed at most 99 (max_model_len=100)"


# ---- prompts ---------------------------------------------------------------------------------
PROMPTS = [
    # bytes ran as token ids
    (b"hello", "prompts=b'hello' is bytes: allowed a string or a list of token ids"),
    (["Hello world", b"hello"], "prompt=b'hello' is bytes"),
    # float token ids were truncated
    ([1.0, 2.0], "prompt=[1.0, 2.0] holds 1.0, not a token id"),
    (["Hello world", [1, 2.7]], "prompt=[1, 2.7] holds 2.7, not a token id"),
    ([[1, True]], "prompt=[1, True] holds True, not a token id"),
    ([1, -1], "prompt=[1, -1] holds the token id -1: allowed a string or a list of token ids in"),
    (["Hello world", None], "prompt=None is a NoneType"),
    ([{"prompt": "x"}], "prompt={'prompt': 'x'} is a dict"),
    (12, "prompts=12 is an int"),
    ("", "prompt is empty: allowed at least one token"),
    (["Hello world", []], "prompt is empty: allowed at least one token"),
]


@pytest.mark.parametrize(("prompts", "message"), PROMPTS)
def test_bad_prompts_are_refused_and_leave_nothing_behind(llm, prompts, message):
    for call in (llm.generate, lambda p, s: list(llm.stream(p, s))):
        error = refusal(call, prompts, GREEDY)
        assert str(error).startswith(message), str(error)
        assert error.param in ("prompt", "prompts")
        assert_idle(llm)  # the good prompt before a bad one is not left queued


# ---- sampling_params -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("params", "message"),
    [
        # a dict gave an AttributeError
        (
            {"temperature": 0},
            "sampling_params={'temperature': 0} is a dict: allowed None, a SamplingParams or "
            "a list of them (one per prompt)",
        ),
        ([GREEDY, {"temperature": 0}], "sampling_params=[SamplingParams("),
        ([GREEDY], "sampling_params has 1 entries for 2 prompts: allowed one, or one per prompt"),
    ],
)
def test_bad_sampling_params_are_refused(llm, params, message):
    error = refusal(llm.generate, ["Hello world", "def fib(n):"], params)
    assert str(error).startswith(message), str(error)
    assert error.param == "sampling_params"
    assert_idle(llm)


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm):
    # [-1] was accepted and, with min_tokens, banned the last vocabulary entry.
    with pytest.raises(InvalidInputError, match=r"^stop_token_ids=\[-1\] holds -1"):
        SamplingParams(stop_token_ids=[-1], min_tokens=2)
    vocab = llm.config.vocab_size
    params = SamplingParams(stop_token_ids=[3, vocab], max_tokens=4)
    error = refusal(llm.generate, "Hello world", params)
    assert str(error) == (
        f"stop_token_ids=[3, {vocab}] holds {vocab}: allowed a list of token ids in 0..{vocab - 1}"
    )
    assert_idle(llm)


def test_a_string_prompt_without_a_tokenizer_is_refused(tiny_model):
    llm = LLM(str(tiny_model[0]), num_kv_blocks=4, block_size=16, progress=False)
    llm.tokenizer = None
    error = refusal(llm.generate, "Hello", GREEDY)
    assert str(error) == (
        "prompt is a string but this engine has no tokenizer: allowed token id lists"
    )
    assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids  # token ids still work


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "kv_cache_dtype='fp8' needs the Triton attention, unavailable here (it needs a CUDA "
         "device): allowed auto, or fp8 with the Triton attention on a CUDA GPU in "
         "float16/bfloat16"),
        ({"attention_backend": "torch"}, "kv_cache_dtype='fp8' does not work with "
         "attention_backend='torch': allowed auto, or fp8 with the Triton attention on a CUDA "
         "GPU in float16/bfloat16"),
    ],
)  # fmt: skip
def test_a_float8_kv_cache_is_refused_where_the_triton_attention_cannot_run(
    tiny_model, options, message
):
    with pytest.raises(InvalidInputError) as e:
        LLM(str(tiny_model[0]), kv_cache_dtype="fp8", progress=False, **options)
    assert str(e.value) == message


def test_an_unknown_kv_cache_dtype_is_one_line():
    with pytest.raises(InvalidInputError) as e:
        EngineConfig(kv_cache_dtype="int8")
    assert str(e.value) == "kv_cache_dtype='int8' is unknown: allowed auto, fp8, fp8_e4m3"
