"""The CLI's handling of bad input and of the flags that reach the API, run in-process
(`nanoqwen.cli.main`) for speed: one line `nanoqwen: error: ...` in flag spelling and exit
status 2 for bad input, 1 for a failure while running; every API knob has its flag."""

from __future__ import annotations

import io
import json
import shutil
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from nanoqwen import LLM, SamplingParams
from nanoqwen.cli import main
from nanoqwen.cli.parser import build_parser

# --repetition-penalty 1: plain greedy (the CLI default is Qwen's 1.05).
QUICK = [
    "--device", "cpu", "--temperature", "0", "--repetition-penalty", "1", "--max-tokens", "6",
    "-q",
]  # fmt: skip


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def run(*args: str, stdin: str | bytes = "") -> Run:
    """main(args) with stdin a pipe holding `stdin`, as `echo ... | nanoqwen ...` gives."""
    data = stdin.encode() if isinstance(stdin, str) else stdin
    out, err, saved = io.StringIO(), io.StringIO(), sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = main(list(args))
    finally:
        sys.stdin = saved
    return Run(code, out.getvalue(), err.getvalue())


def assert_error(r: Run, expected: str, code: int = 2) -> None:
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("nanoqwen: error: ") and expected in lines[0], lines[0]
    assert r.returncode == code and r.stdout == ""


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("NANOQWEN_DEBUG", raising=False)


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model[0])


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(model, num_kv_blocks=64, block_size=16, progress=False)


def chat_ids(llm: LLM, prompt: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": prompt}])


def broken_copy(src: str, dst: Path, name: str, content: bytes | None) -> str:
    """A copy of checkpoint src with file `name` replaced by content (None: removed)."""
    shutil.copytree(src, dst)
    if content is None:
        (dst / name).unlink()
    else:
        (dst / name).write_bytes(content)
    return str(dst)


# ---- bad input: exit 2, one line in flag spelling ----------------------------------------------
ERRORS = {
    "missing model path": (["--model", "/no/such/model"], "model path /no/such/model does not"),
    "dir without config.json": (["--model", "{empty}"], "is a directory without config.json"),
    "bad flag": (["--bogus"], "unrecognized arguments: --bogus"),
    "temperature -1": (["--temperature", "-1"], "--temperature -1.0 is out of range"),
    "top-p 0": (["--top-p", "0"], "--top-p 0.0 is out of range: allowed a number in (0, 1]"),
    "max-tokens 0": (["--max-tokens", "0"], "--max-tokens 0 is out of range"),
    "not a number": (["--temperature", "hot"], "argument --temperature: invalid float value"),
    "top-k 2.5": (["--top-k", "2.5"], "argument --top-k: invalid int value: '2.5'"),
    "dtype int8": (["--dtype", "int8"], "invalid choice: 'int8'"),
    "device tpu": (
        ["--device", "tpu"],
        "--device 'tpu' is unknown: allowed auto, cpu, cuda, cuda:N",
    ),
    "device cuda": (["--device", "cuda"], "--device 'cuda' but CUDA is not available"),
    # API spelling (block_size=3) was shown for a flag before
    "block size": (["--block-size", "3"], "--block-size 3 is out of range: allowed a power of"),
    "max-model-len -5": (["--max-model-len", "-5"], "--max-model-len -5 is out of range"),
    "max-model-len 0": (["--max-model-len", "0"], "--max-model-len 0 is out of range"),
    "max-num-seqs 0": (["--max-num-seqs", "0"], "--max-num-seqs 0 is out of range"),
    "batched tokens": (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens 0 is out"),
    "gpu util": (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5 is out"),
    "presence": (["--presence-penalty", "3"], "--presence-penalty 3.0 is out of range"),
    "frequency": (["--frequency-penalty", "-3"], "--frequency-penalty -3.0 is out of range"),
    "min-tokens": (
        ["--min-tokens", "9", "--max-tokens", "8"],
        "--min-tokens 9 is out of range: allowed an integer from 0 to --max-tokens (8)",
    ),
    "stop token -1": (["--stop-token-ids", "-1"], "--stop-token-ids [-1] holds -1"),
    "stop token past vocab": (
        ["--stop-token-ids", "5,512"],
        "--stop-token-ids [5, 512] holds 512: allowed a list of token ids in 0..511",
    ),
    "stop token x": (["--stop-token-ids", "1,x"], "invalid token id list: '1,x'"),
    "empty stop": (["--stop", ""], "--stop [''] holds an empty string"),
    "backend": (["--attention-backend", "triton"], "--attention-backend 'triton' is unavailable"),
    "missing file": (["--file", "/no/such/prompts.txt"], "--file /no/such/prompts.txt: no such"),
    "bad jsonl": (["--file", "{bad_jsonl}"], ':1: expected an object with a string "prompt"'),
    "jsonl key": (
        ["--file", "{keyed_jsonl}"],
        ':2: key "max_tokens" is a sampling parameter, which a line cannot set: the sampling '
        "flags apply to every prompt",
    ),
    "not utf-8": (["--file", "{latin1}"], "is not UTF-8 text (byte 0xe9 at offset 4)"),
    "system without chat": (["--no-chat", "--system", "S"], "--system needs the chat template"),
    "template without chat": (["--no-chat", "--chat-template", "{{x}}"], "unused with --no-chat"),
    "missing template": (["--chat-template", "/no/such.jinja"], "/no/such.jinja: no such file"),
    "bad template": (["--chat-template", "{% for %}"], "--chat-template holds an invalid chat"),
    "prompt too long": (
        ["--max-model-len", "8"],
        "prompt has 24 tokens: allowed at most 7 (--max-model-len 8)",
    ),
}


@pytest.mark.parametrize("case", ERRORS)
def test_generate_bad_input_is_one_line_and_exit_2(case, model, tmp_path):
    if case == "device cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if case == "backend" and torch.cuda.is_available():
        pytest.skip("triton can run on this machine")
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.jsonl").write_text('["not an object"]\n')
    (tmp_path / "keyed.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b", "max_tokens": 5}\n')
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9\n".encode("latin-1")[:3] + b"\n\xe9\n")
    fill = {
        "empty": tmp_path / "empty",
        "bad_jsonl": tmp_path / "bad.jsonl",
        "keyed_jsonl": tmp_path / "keyed.jsonl",
        "latin1": tmp_path / "latin1.txt",
    }
    flags, expected = ERRORS[case]
    args = [str(fill.get(f[1:-1], f)) if f.startswith("{") else f for f in flags]
    if "--model" not in args:
        args = ["--model", model, *args]
    r = run("generate", "--device", "cpu", "--max-tokens", "4", "-q", *args, "Hello world")
    assert_error(r, expected)


CHECKPOINT_ERRORS = {
    # each was a 20-line traceback or a message that did not name the file
    "truncated weights": ("model.safetensors", "half", "is not a readable safetensors file"),
    "empty weights": ("model.safetensors", b"", "is not a readable safetensors file"),
    "zeroed weights": ("model.safetensors", "zeros", "is not a readable safetensors file"),
    "config a list": ("config.json", b"[1, 2]", "config.json holds a list: allowed a JSON"),
    "heads 0": ("config.json", "heads0", "num_attention_heads=0 is out of range"),
    "tokenizer.json": ("tokenizer.json", b"{nope", "tokenizer.json is not a tokenizer the"),
    "tokenizer_config": ("tokenizer_config.json", b"{", "tokenizer_config.json is not valid JSON"),
    "generation_config": ("generation_config.json", b"", "generation_config.json is not valid"),
    "missing weights": ("model.safetensors", None, "has neither model.safetensors nor"),
}


@pytest.mark.parametrize("case", CHECKPOINT_ERRORS)
def test_a_broken_checkpoint_is_one_line_naming_the_file(case, model, tmp_path):
    name, content, expected = CHECKPOINT_ERRORS[case]
    data = (Path(model) / name).read_bytes()
    if content == "half":
        content = data[: len(data) // 2]
    elif content == "zeros":
        content = bytes(len(data))
    elif content == "heads0":
        content = json.dumps(json.loads(data) | {"num_attention_heads": 0}).encode()
    path = broken_copy(model, tmp_path / "ckpt", name, content)
    r = run("generate", "--model", path, *QUICK, "Hello world")
    assert_error(r, expected)
    if content is not None:
        assert str(Path(path) / name) in r.stderr  # the file is named


def test_a_failure_while_running_is_one_line_and_exit_1(model, monkeypatch):
    def broken_stream(self, prompts, params):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    monkeypatch.setattr(LLM, "stream", broken_stream)
    r = run("generate", "--model", model, *QUICK, "Hello world")
    assert_error(r, "RuntimeError: CUDA error: an illegal memory access was encountered more", 1)
    monkeypatch.setenv("NANOQWEN_DEBUG", "1")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run("generate", "--model", model, *QUICK, "Hello world")


# ---- prompts from stdin and files --------------------------------------------------------------
def json_rows(r: Run) -> list[dict]:
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def expected_text(llm: LLM, prompt: str, **params) -> str:
    sp = SamplingParams(temperature=0.0, max_tokens=6, **params)
    return llm.generate([chat_ids(llm, prompt)], sp)[0].text


def test_stdin_next_to_a_prompt_argument_is_refused(model):
    # It was dropped without a word.
    r = run("generate", "--model", model, *QUICK, "Hello world", stdin="import torch\n")
    assert_error(r, "both PROMPT arguments and text on stdin were given: use one, or pass")
    # Whitespace on stdin (an empty pipe, say) is no prompt, so nothing is lost.
    r = run("generate", "--model", model, *QUICK, "Hello world", stdin="\n  \n")
    assert r.returncode == 0, r.stderr


def test_file_dash_reads_jsonl_by_content_next_to_prompt_arguments(model, llm):
    lines = json.dumps({"prompt": "two\nlines"}) + "\n\n" + json.dumps({"prompt": "Hello"}) + "\n"
    r = run(
        "generate", "--model", model, *QUICK, "--json", "import torch", "--file", "-", stdin=lines
    )
    rows = json_rows(r)
    assert [row["prompt"] for row in rows] == ["import torch", "two\nlines", "Hello"]
    assert [row["text"] for row in rows] == [expected_text(llm, row["prompt"]) for row in rows]
    # --format text takes the same lines as they are.
    r = run("generate", "--model", model, *QUICK, "--json", "--file", "-", "--format", "text",
            stdin=lines)  # fmt: skip
    assert [row["prompt"] for row in json_rows(r)] == [line for line in lines.split("\n") if line]


def test_non_utf8_stdin_is_one_line(model):
    r = run("generate", "--model", model, *QUICK, stdin=b"caf\xe9\n")
    assert_error(r, "stdin is not UTF-8 text (byte 0xe9 at offset 3)")


# ---- flags that reach the API -------------------------------------------------------------------
def test_sampling_flags_reach_sampling_params(model, llm):
    plain = llm.generate(
        [chat_ids(llm, "Hello world")], SamplingParams(temperature=0.0, max_tokens=12)
    )
    stop = plain[0].token_ids[4]
    params = dict(
        presence_penalty=0.5, frequency_penalty=0.3, min_tokens=2, stop_token_ids=[stop],
        ignore_eos=True,
    )  # fmt: skip
    r = run(
        "generate", "--model", model, "--device", "cpu", "--temperature", "0",
        "--repetition-penalty", "1", "--max-tokens",
        "12", "-q", "--json", "--presence-penalty", "0.5", "--frequency-penalty", "0.3",
        "--min-tokens", "2", "--stop-token-ids", str(stop), "--ignore-eos", "Hello world",
    )  # fmt: skip
    [row] = json_rows(r)
    expected = llm.generate(
        [chat_ids(llm, "Hello world")], SamplingParams(temperature=0.0, max_tokens=12, **params)
    )[0]
    assert row["text"] == expected.text and row["completion_tokens"] == len(expected.token_ids)
    assert (row["finish_reason"], row["stop_reason"]) == (
        expected.finish_reason,
        expected.stop_reason,
    )
    if expected.stop_reason == stop:
        assert row["stopped_by"] == "stop_token"


def test_json_and_summary_tell_max_tokens_from_the_context_length(model, llm):
    ids = chat_ids(llm, "Hello world")
    limit = len(ids) + 5
    flags = [*QUICK[:6], "--ignore-eos", "--json"]
    r = run("generate", "--model", model, *flags, "--max-tokens", "3", "Hello world")
    [row] = json_rows(r)
    assert (row["finish_reason"], row["stop_reason"], row["stopped_by"]) == (
        "length",
        None,
        "max_tokens",
    )
    assert "1 cut at --max-tokens 3" in r.stderr
    r = run(
        "generate", "--model", model, *flags, "--max-tokens", "50", "--max-model-len",
        str(limit), "Hello world",
    )  # fmt: skip
    [row] = json_rows(r)
    assert row["completion_tokens"] == 5 and row["stopped_by"] == "max_model_len"
    # It said "cut at the length limit (--max-tokens 50)" after 5 tokens before.
    assert f"1 cut at the context length (--max-model-len {limit})" in r.stderr
    assert "--max-tokens" not in r.stderr


def test_stop_string_is_reported_in_json(model, llm):
    full = expected_text(llm, "Hello world", ignore_eos=True)
    stop = next(full[i : i + 2] for i in range(2, len(full) - 1) if "\ufffd" not in full[i : i + 2])
    r = run(
        "generate",
        "--model",
        model,
        *QUICK,
        "--json",
        "--ignore-eos",
        "--stop",
        stop,
        "Hello world",
    )
    [row] = json_rows(r)
    assert row["text"] == full[: full.index(stop)]
    assert (row["finish_reason"], row["stop_reason"], row["stopped_by"]) == (
        "stop",
        stop,
        "stop_string",
    )


def test_chat_template_flag_replaces_the_models(model, llm, tmp_path):
    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}<|im_start|>"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    for value in (str(path), template):  # a file, or the template text itself
        r = run("generate", "--model", model, *QUICK, "--json", "--chat-template", value, "Hi")
        [row] = json_rows(r)
        ids = llm.tokenizer.encode("<|im_start|>Hi<|im_start|>", add_special_tokens=False)
        assert row["prompt_tokens"] == len(ids)
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=6))[0]
        assert row["text"] == out.text


def test_engine_flags_reach_the_engine(model, llm):
    """One sequence at a time and 8-token steps give the same greedy answers."""
    flags = ["--max-num-seqs", "1", "--max-num-batched-tokens", "8", "--block-size", "16"]
    flags += ["--num-kv-blocks", "8", "--max-model-len", "100", "--gpu-memory-utilization", "0.5"]
    r = run("generate", "--model", model, *QUICK, *flags, "--json", "Hello world", "def fib(n):")
    rows = json_rows(r)
    assert [row["text"] for row in rows] == [
        expected_text(llm, p) for p in ("Hello world", "def fib(n):")
    ]


def test_speculative_config_flag_keeps_the_answers(model, llm):
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'
    r = run("generate", "--model", model, *QUICK, "--speculative-config", spec, "--json",
            "Hello world", "def fib(n):")  # fmt: skip
    rows = json_rows(r)
    assert [row["text"] for row in rows] == [
        expected_text(llm, p) for p in ("Hello world", "def fib(n):")
    ]


def test_a_bad_speculative_config_flag_is_one_line(model):
    r = run("generate", "--model", model, "--speculative-config", '{"method": "eagle"}', "Hi")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "nanoqwen: error: --speculative-config.method='eagle' is unknown: allowed ngram, draft"
    )


# ---- help, the CLI reference -------------------------------------------------------------
CLI_REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def subcommand(name: str):
    parser = build_parser(with_bench=name == "bench")
    return next(a for a in parser._actions if a.dest == "command").choices[name]


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_help_shows_every_default(command):
    r = run(command, "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for action in subcommand(command)._actions:
        switch = action.nargs == 0  # --enforce-eager, --no-prefix-caching: no value to show
        if action.default not in (None, False, [], "==SUPPRESS==") and action.option_strings:
            assert switch or f"(default: {action.default})" in text, action.option_strings


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_cli_reference_names_every_flag_with_its_default(command):
    reference = " ".join(CLI_REFERENCE.read_text().split())
    for action in subcommand(command)._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = action.option_strings[-1]
        assert f"`{flag}" in reference, f"docs/cli.md does not mention {flag}"
        if action.default not in (None, False, [], "==SUPPRESS==") and action.nargs != 0:
            assert f"`{flag} {action.default}`" in reference, f"docs/cli.md's default for {flag}"


def test_attention_backend_help_says_what_auto_picks():
    r = run("generate", "--help")
    assert "auto: triton" in " ".join(r.stdout.split())


# ---- bench -------------------------------------------------------------------------------------
def test_bench_checks_its_arguments_before_loading():
    r = run("bench", "--model", "/no/such/model", "--batch-sizes", "1,0")
    assert_error(r, "argument --batch-sizes: invalid batch sizes '1,0'")
    r = run("bench", "--model", "/no/such/model", "--device", "cpu", "--new-tokens", "1")
    assert_error(r, "--new-tokens 1 is out of range: allowed >= 2")


def test_bench_states_the_ceiling_of_its_own_device(model):
    r = run(
        "bench", "--model", model, "--device", "cpu", "--dtype", "float32", "--mode",
        "latency", "--batch-sizes", "1", "--prompt-len", "4", "--new-tokens", "3",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "a copy measured on cpu" in r.stdout and "H200" not in r.stdout
