"""The `nanoqwen` command, run as a user runs it: `python -m nanoqwen ...` in a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanoqwen import LLM, SamplingParams
from nanoqwen.cli.chat import run_chat
from nanoqwen.cli.flags import flag_spelling

REPO = Path(__file__).resolve().parents[1]
# --device cpu: the in-process reference LLM runs on the CPU, even where CUDA is available.
# --repetition-penalty 1: the CLI default (1.05, Qwen's) would part from plain greedy.
GREEDY = [
    "--device",
    "cpu",
    "--temperature",
    "0",
    "--repetition-penalty",
    "1",
    "--max-tokens",
    "12",
]


class Result:
    def __init__(self, proc: subprocess.CompletedProcess) -> None:
        self.returncode = proc.returncode
        # Bytes decoded by hand: text mode would turn a generated "\r" into "\n".
        self.stdout = proc.stdout.decode("utf-8")
        self.stderr = proc.stderr.decode("utf-8")


def cli(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> Result:
    base = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    base.pop("NANOQWEN_DEBUG", None)
    env = base | (env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "nanoqwen", *args],
        cwd=REPO,
        input=stdin.encode(),
        capture_output=True,
        env=env,
        timeout=300,
    )
    return Result(proc)


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model[0])


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(model, progress=False)


def chat_ids(llm: LLM, prompt: str, system: str | None = None) -> list[int]:
    head = [{"role": "system", "content": system}] if system is not None else []
    return llm.tokenizer.encode_chat([*head, {"role": "user", "content": prompt}])


def greedy(llm: LLM, ids, max_tokens: int = 12, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    return llm.generate([ids], params)[0]


def as_printed(text: str) -> str:
    """What the CLI prints for one answer: the text, ending with a newline."""
    return text if text.endswith("\n") else text + "\n"


# ---- generate ------------------------------------------------------------------------------
def test_generate_streams_what_llm_generate_gives(model, llm):
    r = cli("generate", "--model", model, *GREEDY, "Hello world")
    assert r.returncode == 0, r.stderr
    expected = greedy(llm, chat_ids(llm, "Hello world"))
    assert r.stdout == as_printed(expected.text)
    # Not quiet: the engine's log lines and the speed summary go to stderr.
    assert "[nanoqwen] attention backend: torch" in r.stderr
    assert f"-> {len(expected.token_ids)} tokens in" in r.stderr and "tok/s" in r.stderr


def test_kv_cache_flags(model, llm):
    r = cli(
        "generate", "--model", model, *GREEDY, "--no-prefix-caching",
        "--preemption-mode", "recompute", "--swap-space", "0", "--block-size", "4",
        "--num-kv-blocks", "64", "Hello world",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout == as_printed(greedy(llm, chat_ids(llm, "Hello world")).text)
    assert "host KV pool" not in r.stderr
    r = cli("generate", "--model", model, *GREEDY, "--swap-space", "0.001", "Hello world")
    assert r.returncode == 0, r.stderr
    assert "[nanoqwen] host KV pool:" in r.stderr and "preemption: swap" in r.stderr
    r = cli("generate", "--model", model, "--preemption-mode", "later", "Hello world")
    assert r.returncode == 2 and "--preemption-mode" in r.stderr and "'later'" in r.stderr


def test_tensor_parallel_with_the_default_device(model):
    """--device auto (the default) picks the device once, for every rank."""
    r = cli("generate", "--model", model, "--tensor-parallel-size", "2", "--temperature", "0",
            "--max-tokens", "5", "--ignore-eos", "Hello world")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "-> 5 tokens in" in r.stderr


def test_chat_template_applied_unless_no_chat(model, llm):
    chat = cli("generate", "--model", model, *GREEDY, "-q", "The quick brown fox")
    raw = cli("generate", "--model", model, *GREEDY, "-q", "--no-chat", "The quick brown fox")
    assert chat.returncode == raw.returncode == 0
    assert raw.stdout == as_printed(greedy(llm, llm.encode("The quick brown fox")).text)
    assert chat.stdout == as_printed(greedy(llm, chat_ids(llm, "The quick brown fox")).text)
    assert chat.stdout != raw.stdout


def test_system_prompt(model, llm):
    r = cli("generate", "--model", model, *GREEDY, "-q", "--system", "Be brief.", "Hi")
    assert r.returncode == 0, r.stderr
    assert r.stdout == as_printed(greedy(llm, chat_ids(llm, "Hi", system="Be brief.")).text)


def test_stop_string_cuts_the_answer(model, llm):
    full = greedy(llm, chat_ids(llm, "Hello world"), max_tokens=20).text
    if len(full) < 8:
        pytest.skip("the tiny model's answer is too short to cut")
    stop = full[4:6]
    flags = [*GREEDY[:6], "--max-tokens", "20", "-q", "--stop", stop]
    r = cli("generate", "--model", model, *flags, "Hello world")
    assert r.returncode == 0, r.stderr
    assert r.stdout == as_printed(full[: full.index(stop)])


def test_several_prompts_print_in_order_under_headers(model, llm):
    r = cli("generate", "--model", model, *GREEDY, "-q", "Hello world", "import torch")
    assert r.returncode == 0, r.stderr
    a = greedy(llm, chat_ids(llm, "Hello world")).text
    b = greedy(llm, chat_ids(llm, "import torch")).text
    assert r.stdout == (
        "### 1/2: Hello world\n" + as_printed(a) + "\n### 2/2: import torch\n" + as_printed(b)
    )
    assert r.stderr == ""  # --quiet


def test_json_lines(model, llm):
    r = cli("generate", "--model", model, *GREEDY, "--json", "Hello world", "import torch")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["prompt"] for row in rows] == ["Hello world", "import torch"]
    for row in rows:
        ids = chat_ids(llm, row["prompt"])
        out = greedy(llm, ids)
        assert row["text"] == out.text
        assert row["prompt_tokens"] == len(ids)
        assert row["completion_tokens"] == len(out.token_ids)
        assert row["finish_reason"] == out.finish_reason
        assert 0 < row["ttft_s"] <= row["total_s"]
        assert row["tok_per_s"] == pytest.approx(row["completion_tokens"] / row["total_s"], 1e-2)
    assert "tok/s" in r.stderr  # the summary still goes to stderr


def test_file_one_prompt_per_line(model, llm, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("Hello world\n\nimport torch\n")
    r = cli("generate", "--model", model, *GREEDY, "--json", "-q", "--file", str(f))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["prompt"] for row in rows] == ["Hello world", "import torch"]
    assert [row["text"] for row in rows] == [
        greedy(llm, chat_ids(llm, p)).text for p in ("Hello world", "import torch")
    ]


def test_file_jsonl(model, llm, tmp_path):
    f = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": "two\nlines"}), "", json.dumps({"prompt": "Hello", "x": 1})]
    f.write_text("\n".join(lines) + "\n")
    r = cli("generate", "--model", model, *GREEDY, "-q", "--file", str(f))
    assert r.returncode == 0, r.stderr
    a, b = (greedy(llm, chat_ids(llm, p)).text for p in ("two\nlines", "Hello"))
    assert r.stdout == "### 1/2: two lines\n" + as_printed(a) + "\n### 2/2: Hello\n" + as_printed(b)


def test_prompt_from_stdin(model, llm):
    r = cli("generate", "--model", model, *GREEDY, "-q", stdin="def fib(n):\n    return n\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == as_printed(greedy(llm, chat_ids(llm, "def fib(n):\n    return n")).text)


# ---- errors: one line on stderr, no traceback (more in test_cli_input.py, in-process) -----
@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--model", "{model}"],
        ["nonsense"],
        [],
        ["chat", "--model", "{model}", "--top-k", "-5"],
        ["generate", "--model", "{model}", "--block-size", "3", "Hi"],
    ],
)
def test_usage_errors_exit_2(args, model):
    r = cli(*[a.format(model=model) for a in args])
    assert_one_line_error(r, "")
    assert r.returncode == 2


@pytest.mark.parametrize("value", ["0", "false", "", "no"])
def test_only_a_true_nanoqwen_debug_shows_the_traceback(model, value):
    args = ("generate", "--model", model, "--block-size", "3", "Hi")
    r = cli(*args, env={"NANOQWEN_DEBUG": value})
    assert_one_line_error(r, "--block-size 3 is out of range")
    if value == "0":  # the same command with a true value: the traceback instead
        r = cli(*args, env={"NANOQWEN_DEBUG": "1"})
        assert r.returncode != 0
        assert r.stderr.startswith("Traceback") and "InvalidInputError" in r.stderr


def assert_one_line_error(r: Result, expected: str) -> None:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("nanoqwen: error: ") and expected in lines[0], lines[0]
    assert r.stdout == ""


# ---- structured output ---------------------------------------------------------------------
USER = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("flag", "content", "expected"),
    [
        ("--json-schema", None, "--json-schema {path}: no such file"),
        ("--grammar", None, "--grammar {path}: no such file"),
        ("--json-schema", "not json\n", "--json-schema {path} is not valid JSON (Expecting value "
         "at line 1 column 1)"),
        ("--json-schema", "[1]", "--json-schema {path} holds a list: allowed a JSON object"),
    ],
)  # fmt: skip
def test_structured_output_files_are_checked_before_loading(flag, content, expected, tmp_path):
    """A model that does not exist: the file's error comes first."""
    path = tmp_path / "spec.txt"
    if content is not None:
        path.write_text(content)
    r = cli("generate", "--model", "/no/such/model", flag, str(path), "Hi")
    assert_one_line_error(r, expected.format(path=path))
    assert r.returncode == 2


def test_json_schema_text_on_the_command_line_is_checked():
    r = cli("generate", "--model", "/no/such/model", "--json-schema", "{name: 1}", "Hi")
    assert_one_line_error(r, "--json-schema is not valid JSON (Expecting property name enclosed in")
    assert r.returncode == 2


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_structured_output_flags_are_one_of(command):
    r = cli(command, "--json-object", "--regex", "[0-9]+", "Hi")
    assert_one_line_error(r, "argument --regex: not allowed with argument --json-object")
    assert r.returncode == 2 and f"(see `nanoqwen {command} --help`)" in r.stderr


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("structured_output.json cannot be compiled: x", "--json-schema cannot be compiled: x"),
        ("structured_output.json_object: x", "--json-object: x"),
        ("structured_output.regex='' is not a non-empty string", "--regex '' is not a non-empty "
         "string"),
        ("structured_output.grammar cannot be compiled.", "--grammar cannot be compiled."),
        ("structured_output.json.properties.age is not a valid JSON schema",
         "--json-schema's properties.age is not a valid JSON schema"),
        ("allowed json, json_object, regex, grammar", "allowed json, json_object, regex, grammar"),
    ],
)  # fmt: skip
def test_engine_messages_about_structured_output_name_the_flag(message, expected):
    assert flag_spelling(message) == expected


def real_generate(model_dir: Path, *args: str) -> dict:
    """One greedy --json result from the real checkpoint, on the CPU."""
    flags = ["--device", "cpu", "--temperature", "0", "--max-tokens", "200", "--json", "-q"]
    r = cli("generate", "--model", str(model_dir), *flags, *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.real_model
def test_json_schema_answer_validates(real_model_dir, tmp_path):
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    schema = tmp_path / "user.json"
    schema.write_text(json.dumps(USER))
    row = real_generate(real_model_dir, "Give me a user record for Ana, who is 31.",
                        "--json-schema", str(schema))  # fmt: skip
    assert row["finish_reason"] == "stop", row
    jsonschema.validate(json.loads(row["text"]), USER)


@pytest.mark.real_model
def test_regex_answer_matches(real_model_dir):
    pytest.importorskip("xgrammar")
    pattern = "[0-9]{3}-[0-9]{4}"
    row = real_generate(real_model_dir, "Give me a phone number.", "--regex", pattern)
    assert re.fullmatch(pattern, row["text"]), row


# ---- chat ----------------------------------------------------------------------------------
def test_chat_two_turns_reset_exit(model, llm):
    turns = "Hello world\nimport torch\n/reset\nHello world\n/exit\nnever answered\n"
    r = cli("chat", "--model", model, *GREEDY, stdin=turns)
    assert r.returncode == 0, r.stderr
    history = [{"role": "user", "content": "Hello world"}]
    a1 = greedy(llm, llm.tokenizer.encode_chat(history)).text
    history += [
        {"role": "assistant", "content": a1},
        {"role": "user", "content": "import torch"},
    ]
    a2 = greedy(llm, llm.tokenizer.encode_chat(history)).text
    # After /reset the same first question gets the same first answer.
    assert r.stdout == as_printed(a1) + as_printed(a2) + as_printed(a1)
    assert "history cleared" in r.stderr
    assert "Traceback" not in r.stderr


def test_chat_quits_at_end_of_input(model):
    r = cli("chat", "--model", model, *GREEDY, "-q", stdin="Hello world\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout and r.stderr == ""


def test_chat_ctrl_c_stops_the_answer_and_keeps_the_session(llm, monkeypatch, capsys):
    """Ctrl-C arrives in the real engine's third step of the first answer: the text up to
    there is printed and kept in the history, the request is aborted (its KV blocks freed),
    and the next turn runs on the conversation with the partial answer in it."""
    lines = iter(["Hello world", "import torch"])

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise KeyboardInterrupt from None  # Ctrl-C at the prompt quits

    steps, step = [0], llm.step

    def step_then_interrupt():
        steps[0] += 1
        if steps[0] == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr("builtins.input", fake_input)
    monkeypatch.setattr(llm, "step", step_then_interrupt)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    assert run_chat(llm, params, "sys", quiet=True) == 0
    out, err = capsys.readouterr()
    assert "answer stopped (Ctrl-C)" in err

    system = [{"role": "system", "content": "sys"}]
    first = [*system, {"role": "user", "content": "Hello world"}]
    full = greedy(llm, llm.tokenizer.encode_chat(first)).text
    partial = out[: out.index("\n")] if "\n" in out else out
    # Two steps ran (the first two tokens' text, as far as the detokenizer released it).
    assert full.startswith(partial) and len(partial) < len(full)
    second = [*first, {"role": "assistant", "content": partial}]
    second.append({"role": "user", "content": "import torch"})
    expected = greedy(llm, llm.tokenizer.encode_chat(second)).text
    assert out == as_printed(partial) + as_printed(expected)
    sched = llm.scheduler
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks
    assert not sched.waiting and not sched.running


# ---- help, version, bench ------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_subcommand_help_shows_defaults(command):
    r = cli(command, "--help")
    assert r.returncode == 0 and r.stderr == ""
    assert "(default: 512)" in r.stdout
    flat = " ".join(r.stdout.split())
    assert "generation_config.json" in flat and "temperature 0.7, top-p 0.8, top-k 20" in flat


def test_sampling_defaults_come_from_generation_config(tmp_path, model, llm):
    """A checkpoint whose generation_config.json asks for temperature 0 decodes greedily
    without any flag; a flag still wins over the file."""
    ck = tmp_path / "ck"
    ck.mkdir()
    for f in Path(model).iterdir():
        (ck / f.name).symlink_to(f)
    (ck / "generation_config.json").unlink(missing_ok=True)
    (ck / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5}))
    r = cli("generate", "--model", str(ck), "--device", "cpu", "--max-tokens", "12", "-q", "Hi")
    assert r.returncode == 0, r.stderr
    assert r.stdout == as_printed(greedy(llm, chat_ids(llm, "Hi")).text)
    from nanoqwen.cli.engine import sampling_params
    from nanoqwen.cli.parser import build_parser

    args = build_parser().parse_args(["generate", "--model", str(ck), "--temperature", "0.9"])
    params = sampling_params(args)
    assert (params.temperature, params.top_k, params.top_p) == (0.9, 5, 0.8)
    assert params.repetition_penalty == 1.05  # the Qwen value: the file names none


def test_json_logprobs(model, llm):
    r = cli("generate", "--model", model, *GREEDY, "--json", "--logprobs", "2", "-q", "Hi")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    expected = llm.generate(
        [chat_ids(llm, "Hi")], SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    )[0]
    assert [e["token_id"] for e in out["logprobs"]] == expected.token_ids
    assert [e["logprob"] for e in out["logprobs"]] == pytest.approx(
        [e.logprob for e in expected.logprobs], abs=1e-5
    )
    first = out["logprobs"][0]
    assert first["rank"] == 1 and len(first["top"]) == 2
    assert first["top"][0]["token_id"] == first["token_id"]
    assert first["token"] == llm.tokenizer.decode([first["token_id"]])


def test_top_level_help_and_version():
    r = cli("--help")
    assert r.returncode == 0 and all(c in r.stdout for c in ("generate", "chat", "bench"))
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == "nanoqwen 0.1.0"


def test_bench_help_delegates_to_the_bench_module():
    r = cli("bench", "--help")
    assert r.returncode == 0, r.stderr
    assert "--shape {0.5B,1.5B,3B,7B,14B,32B,72B}" in r.stdout and "(default: 0.5B)" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the bench's default device is CUDA")
def test_the_bench_module_fails_in_one_line_as_the_command_does():
    env = {k: v for k, v in os.environ.items() if k != "NANOQWEN_DEBUG"}
    r = subprocess.run([sys.executable, "-m", "nanoqwen.bench", "--mode", "latency"], cwd=REPO,
                       capture_output=True, text=True, env=env)  # fmt: skip
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (
        "python -m nanoqwen.bench: error: device='cuda' but CUDA is not available on this "
        "machine: allowed cpu\n"
    )
