"""Tokenizer: encode/decode and chat rendering equal transformers' AutoTokenizer; the chat
template's source (chat_template.jinja wins over tokenizer_config.json); EOS ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import build_tokenizer
from tokenizers import Regex, normalizers, pre_tokenizers
from transformers import AutoTokenizer

from nanoqwen import LLM, InvalidInputError
from nanoqwen.weights.tokenizer import Tokenizer

# Qwen2.5's pre-tokenizer, as its tokenizer.json has it (transformers 5's Qwen2Tokenizer
# applies this pipeline whatever tokenizer.json says, so the test tokenizer uses it too).
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2.5-Instruct's chat template.
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501

# Depends on trim_blocks / lstrip_blocks and on transformers' non-ASCII tojson.
WHITESPACE_TEMPLATE = """{% for m in messages %}
    {% if m['role'] == 'system' %}
[SYS] {{ m['content'] | tojson }}
    {% else %}
<{{ m['role'] }}> {{ m['content'] }} #{{ loop.index }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<assistant>
{% endif %}"""

CONVERSATION = [
    {"role": "system", "content": "You are terse. 说中文。"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And in words?\n  Think <first>."},
    {"role": "assistant", "content": "四 (four)."},
    {"role": "user", "content": "谢谢! 'quoted' \"double\""},
]

TEXTS = [
    "Hello world! How are you today?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\n",
    "  leading   and trailing spaces   ",
    "你好，世界。今天天气很好。",
    "numbers 1234567 and 3.14159, contractions: I'm, you'll, it's, WE'RE",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "tabs\tand\r\nwindows\rlines",
    "cafe\u0301 vs café",  # NFC folds the combining accent
    "emoji 🤖🚀 and symbols ∑∫≠",
]


def write_tokenizer_dir(src: Path, dst: Path, **config) -> Path:
    """A checkpoint dir (config.json etc. from src) with a Qwen-style tokenizer.json and the
    given tokenizer_config.json entries."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "tokenizer*"))
    tok = build_tokenizer()
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.save(str(dst / "tokenizer.json"))
    cfg = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
    cfg.update(config)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def qwen_dir(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return write_tokenizer_dir(tiny_model[0], root / "qwen", chat_template=QWEN25_TEMPLATE)


def hf_render(path: Path, messages, add_generation_prompt=True) -> str:
    hf = AutoTokenizer.from_pretrained(str(path))
    return hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


# ---- encode / decode ---------------------------------------------------------------------------
def test_encode_and_decode_equal_hf(qwen_dir):
    ours = Tokenizer(qwen_dir)
    hf = AutoTokenizer.from_pretrained(str(qwen_dir))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids), text
    assert ours.vocab_size == len(hf)


def test_special_tokens_are_single_ids_and_skipped_when_decoding(tiny_model):
    """The wrapper's own choices: special tokens in text become their ids, decode drops them
    by default (as HF's skip_special_tokens=True) and keeps them when asked."""
    tok = Tokenizer(tiny_model[0])
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    ids = tok.encode("<|im_start|>user\nHello world<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end
    assert im_start not in ids[1:-1] and im_end not in ids[1:-1]
    assert tok.decode(ids) == "user\nHello world"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHello world<|im_end|>"
    for text in TEXTS[:5]:  # byte-level BPE without a normalizer: an exact round trip
        assert tok.decode(tok.encode(text)) == text, text
    assert tok.vocab_size == 400


# ---- chat template -----------------------------------------------------------------------------
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen_chat_template_renders_like_hf(qwen_dir, add_generation_prompt):
    ours = Tokenizer(qwen_dir).render_chat(CONVERSATION, add_generation_prompt)
    expected = hf_render(qwen_dir, CONVERSATION, add_generation_prompt)
    assert ours == expected
    assert ours.startswith("<|im_start|>system\nYou are terse. 说中文。<|im_end|>\n")
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_default_system_prompt_and_tool_messages_render_like_hf(qwen_dir):
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking."},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"sky": "clear"}'},
        {"role": "user", "content": "Thanks"},
    ]
    ours = Tokenizer(qwen_dir).render_chat(messages)
    assert ours == hf_render(qwen_dir, messages)
    assert "You are Qwen, created by Alibaba Cloud." in ours


def test_encode_chat_equals_hf_tokenized_template(qwen_dir):
    ours = Tokenizer(qwen_dir).encode_chat(CONVERSATION)
    hf = AutoTokenizer.from_pretrained(str(qwen_dir))
    expected = hf.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert ours == list(expected)


def test_whitespace_sensitive_template_renders_like_hf(tiny_model, tmp_path):
    path = write_tokenizer_dir(tiny_model[0], tmp_path / "ws", chat_template=WHITESPACE_TEMPLATE)
    ours = Tokenizer(path).render_chat(CONVERSATION)
    assert ours == hf_render(path, CONVERSATION)
    assert '[SYS] "You are terse. 说中文。"' in ours  # tojson keeps non-ASCII


def test_chat_template_jinja_file_wins(tiny_model, tmp_path):
    path = write_tokenizer_dir(tiny_model[0], tmp_path / "both", chat_template=QWEN25_TEMPLATE)
    (path / "chat_template.jinja").write_text(WHITESPACE_TEMPLATE)
    ours = Tokenizer(path)
    assert ours.chat_template == WHITESPACE_TEMPLATE
    assert ours.render_chat(CONVERSATION) == hf_render(path, CONVERSATION)
    assert "[SYS]" in ours.render_chat(CONVERSATION)


def test_chat_template_jinja_file_alone(tiny_model, tmp_path):
    path = write_tokenizer_dir(tiny_model[0], tmp_path / "jinja")
    (path / "chat_template.jinja").write_text(QWEN25_TEMPLATE)
    assert Tokenizer(path).render_chat(CONVERSATION) == hf_render(path, CONVERSATION)


def test_named_templates_take_the_default(tiny_model, tmp_path):
    named = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": WHITESPACE_TEMPLATE},
    ]
    path = write_tokenizer_dir(tiny_model[0], tmp_path / "named", chat_template=named)
    assert Tokenizer(path).chat_template == WHITESPACE_TEMPLATE


def test_no_chat_template(tiny_model, tmp_path):
    path = write_tokenizer_dir(tiny_model[0], tmp_path / "none")
    tok = Tokenizer(path)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.render_chat(CONVERSATION)


def test_raise_exception_in_a_template_surfaces(tiny_model, tmp_path):
    from jinja2.exceptions import TemplateError

    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    path = write_tokenizer_dir(tiny_model[0], tmp_path / "raise", chat_template=template)
    with pytest.raises(TemplateError, match="user first"):
        Tokenizer(path).render_chat(CONVERSATION)


# ---- EOS ids -----------------------------------------------------------------------------------
def ids_of(tok: Tokenizer, *tokens: str) -> set[int]:
    return {tok.token_to_id(t) for t in tokens}


@pytest.mark.parametrize(
    ("generation_config", "config_eos", "eos_token", "expected"),
    [
        # generation_config as a list, tokenizer eos_token inside it
        ({"eos_token_id": ["<|im_end|>", "<|endoftext|>"]}, None, "<|im_end|>", ["im", "end"]),
        # generation_config as an int, tokenizer eos_token another token: the union
        ({"eos_token_id": "<|endoftext|>"}, None, "<|im_end|>", ["im", "end"]),
        # no generation_config: config.json's eos_token_id
        (None, "<|endoftext|>", "<|im_end|>", ["im", "end"]),
        # generation_config without eos_token_id: config.json's still counts
        ({"do_sample": True}, "<|endoftext|>", "<|im_end|>", ["im", "end"]),
        # nothing but the tokenizer's eos_token
        (None, None, "<|im_end|>", ["im"]),
        # no eos_token in tokenizer_config
        ({"eos_token_id": ["<|im_start|>"]}, None, None, ["start"]),
    ],
)
def test_eos_ids_are_the_union(
    tiny_model, tmp_path, generation_config, config_eos, eos_token, expected
):
    path = write_tokenizer_dir(tiny_model[0], tmp_path / "eos", eos_token=eos_token)
    tok = Tokenizer(path)
    names = {"im": "<|im_end|>", "end": "<|endoftext|>", "start": "<|im_start|>"}

    def to_id(value):
        return (
            [tok.token_to_id(v) for v in value]
            if isinstance(value, list)
            else tok.token_to_id(value)
        )

    (path / "generation_config.json").unlink()
    if generation_config is not None:
        gen = {k: to_id(v) if k == "eos_token_id" else v for k, v in generation_config.items()}
        (path / "generation_config.json").write_text(json.dumps(gen))
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("eos_token_id", None)
    if config_eos is not None:
        cfg["eos_token_id"] = to_id(config_eos)
    (path / "config.json").write_text(json.dumps(cfg))

    tok = Tokenizer(path)
    assert tok.eos_token_ids == ids_of(tok, *(names[e] for e in expected))


def test_engine_uses_the_tokenizer_eos_ids(tiny_model):
    llm = LLM(str(tiny_model[0]), num_kv_blocks=2, block_size=16, progress=False)
    assert llm.eos_token_ids == ids_of(llm.tokenizer, "<|im_end|>") == {2}
    assert llm.runner.sampler.eos_token_ids == llm.eos_token_ids


def test_missing_tokenizer_json_is_named(tiny_model, tmp_path):
    path = tmp_path / "notok"
    shutil.copytree(tiny_model[0], path, ignore=shutil.ignore_patterns("tokenizer.json"))
    with pytest.raises(FileNotFoundError, match=rf"{path} has no tokenizer.json"):
        Tokenizer(path)


# ---- files that cannot be read: one line naming the file ----------------------------------------
def test_an_invalid_tokenizer_json_is_named(tiny_model, tmp_path):
    path = write_tokenizer_dir(tiny_model[0], tmp_path / "bad")
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(InvalidInputError) as info:
        Tokenizer(path)
    message = str(info.value)
    assert message.startswith(f"{path / 'tokenizer.json'} is not a tokenizer the tokenizers ")
    assert "\n" not in message


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        # "Expecting value: line 1 column 1" named no file before
        ("tokenizer_config.json", "", "is not valid JSON (Expecting value at line 1 column 1)"),
        ("generation_config.json", "{", "is not valid JSON (Expecting property name"),
        ("generation_config.json", "[5]", "holds a list: allowed a JSON object"),
        ("tokenizer_config.json", b"\xff", "is not UTF-8 text (byte 0xff at offset 0)"),
        ("chat_template.jinja", "{% for %}", "holds an invalid chat template (line 1: "),
        ("chat_template.jinja", b"\xfe{{x}}", "is not UTF-8 text (byte 0xfe at offset 0)"),
    ],
)
def test_unreadable_tokenizer_files_are_named(tiny_model, tmp_path, name, content, expected):
    path = write_tokenizer_dir(tiny_model[0], tmp_path / "bad")
    data = content if isinstance(content, bytes) else content.encode()
    (path / name).write_bytes(data)
    with pytest.raises(InvalidInputError) as info:
        Tokenizer(path)
    assert str(info.value).startswith(f"{path / name} {expected}"), str(info.value)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"eos_token": 5}, "tokenizer_config.json: eos_token=5 is not a token"),
        ({"chat_template": 7}, "tokenizer_config.json: chat_template=7 is not a string"),
        ({"chat_template": [{"name": 1}]}, "tokenizer_config.json: chat_template=[{'name': 1}]"),
        ({"chat_template": "{% if %}"}, "tokenizer_config.json holds an invalid chat template"),
    ],
)
def test_bad_tokenizer_config_entries_are_named(tiny_model, tmp_path, config, expected):
    path = write_tokenizer_dir(tiny_model[0], tmp_path / "bad", **config)
    with pytest.raises(InvalidInputError) as info:
        Tokenizer(path)
    assert expected in str(info.value)


def test_a_bad_eos_token_id_in_generation_config_is_named(tiny_model, tmp_path):
    path = write_tokenizer_dir(tiny_model[0], tmp_path / "bad")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, -1]}))
    with pytest.raises(InvalidInputError) as info:
        Tokenizer(path)
    assert str(info.value) == (
        f"{path / 'generation_config.json'}: eos_token_id=[2, -1] holds -1: "
        "allowed a list of token ids >= 0"
    )
