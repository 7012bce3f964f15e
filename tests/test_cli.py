"""The `nanoqwen` command, run as a user runs it: `python -m nanoqwen ...` in a subprocess."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanoqwen import LLM, SamplingParams
from nanoqwen.chat import run_chat
from nanoqwen.runtime.engine import StreamChunk

REPO = Path(__file__).resolve().parents[1]
# --device cpu: the in-process reference LLM runs on the CPU, even where CUDA is available.
GREEDY = ["--device", "cpu", "--temperature", "0", "--max-tokens", "12"]


class Result:
    def __init__(self, proc: subprocess.CompletedProcess) -> None:
        self.returncode = proc.returncode
        # Bytes decoded by hand: text mode would turn a generated "\r" into "\n".
        self.stdout = proc.stdout.decode("utf-8")
        self.stderr = proc.stderr.decode("utf-8")


def cli(*args: str, stdin: str = "") -> Result:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    env.pop("NANOQWEN_DEBUG", None)
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
    flags = ["--device", "cpu", "--temperature", "0", "--max-tokens", "20", "-q", "--stop", stop]
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


# ---- errors: one line on stderr, no traceback -----------------------------------------------
ERRORS = {
    "missing model path": (["--model", "/no/such/model"], "does not exist"),
    "dir without config.json": (["--model", "{empty}"], "without config.json"),
    "bad flag": (["--model", "{model}", "--bogus"], "unrecognized arguments: --bogus"),
    "temperature -1": (["--model", "{model}", "--temperature", "-1"], "--temperature -1.0"),
    "top-p 0": (["--model", "{model}", "--top-p", "0"], "--top-p 0.0"),
    "top-p 2": (["--model", "{model}", "--top-p", "2"], "--top-p 2.0"),
    "max-tokens 0": (["--model", "{model}", "--max-tokens", "0"], "--max-tokens 0"),
    "not a number": (["--model", "{model}", "--temperature", "hot"], "invalid float value"),
    "dtype int8": (["--model", "{model}", "--dtype", "int8"], "invalid choice: 'int8'"),
    "device cuda": (["--model", "{model}", "--device", "cuda"], "CUDA is not available"),
    "device tpu": (["--model", "{model}", "--device", "tpu"], "device='tpu'"),
    "block size": (["--model", "{model}", "--block-size", "3"], "block_size=3"),
    "missing file": (["--model", "{model}", "--file", "/no/such/prompts.txt"], "no such file"),
    "bad jsonl": (["--model", "{model}", "--file", "{bad_jsonl}"], ":1: expected an object"),
    "system without chat": (["--model", "{model}", "--no-chat", "--system", "S"], "--no-chat"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_generate_errors_are_one_line(case, model, tmp_path):
    if case == "device cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.jsonl").write_text('["not an object"]\n')
    fill = {"model": model, "empty": tmp_path / "empty", "bad_jsonl": tmp_path / "bad.jsonl"}
    flags, expected = ERRORS[case]
    r = cli("generate", *[f.format(**fill) for f in flags], "Hello")
    assert_one_line_error(r, expected)


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--model", "{model}"],
        ["nonsense"],
        [],
        ["chat", "--model", "{model}", "--top-k", "-5"],
    ],
)
def test_other_usage_errors(args, model):
    r = cli(*[a.format(model=model) for a in args])
    assert_one_line_error(r, "")
    assert r.returncode == 2


def assert_one_line_error(r: Result, expected: str) -> None:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("nanoqwen: error: ") and expected in lines[0], lines[0]
    assert r.stdout == ""


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


class _FakeTokenizer:
    chat_template = "fake"

    def encode_chat(self, messages):
        return [dict(m) for m in messages]  # the conversation itself, to check the history


class _FakeLLM:
    """Answers "partial " then gets Ctrl-C on the first turn, "fine" on the others."""

    def __init__(self) -> None:
        self.tokenizer = _FakeTokenizer()
        self.prompts: list = []
        self.closed = 0

    def stream(self, prompts, params):
        self.prompts.append(prompts[0])
        first = len(self.prompts) == 1

        def chunks():
            try:
                if first:
                    yield StreamChunk(0, "partial ", [1], False, None)
                    raise KeyboardInterrupt
                yield StreamChunk(0, "fine", [2], True, "stop")
            finally:
                self.closed += 1

        return chunks()


def test_chat_ctrl_c_stops_the_answer_and_keeps_the_session(monkeypatch, capsys):
    lines = iter(["first", "second"])

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise KeyboardInterrupt from None  # Ctrl-C at the prompt quits

    monkeypatch.setattr("builtins.input", fake_input)
    fake = _FakeLLM()
    assert run_chat(fake, SamplingParams(), "sys", quiet=True) == 0
    out, err = capsys.readouterr()
    assert out == "partial \nfine\n"
    assert "answer stopped" in err
    assert fake.closed == 2
    assert fake.prompts[1] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "partial "},
        {"role": "user", "content": "second"},
    ]


# ---- help, version, bench ------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_subcommand_help_shows_defaults(command):
    r = cli(command, "--help")
    assert r.returncode == 0 and r.stderr == ""
    assert "(default: 512)" in r.stdout and "(default: 0.7)" in r.stdout


def test_top_level_help_and_version():
    r = cli("--help")
    assert r.returncode == 0 and all(c in r.stdout for c in ("generate", "chat", "bench"))
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == "nanoqwen 0.1.0"


@pytest.mark.skipif(
    importlib.util.find_spec("nanoqwen.runtime.bench") is None,
    reason="nanoqwen.runtime.bench is not written yet",
)
def test_bench_help_delegates_to_the_bench_module():
    r = cli("bench", "--help")
    assert r.returncode == 0, r.stderr
    assert "--shape" in r.stdout and "default:" in r.stdout
