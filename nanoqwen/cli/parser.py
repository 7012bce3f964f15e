"""The `nanoqwen` command line: its commands, their own flags and help texts (the flags
they share are cli/flags.py's)."""

from __future__ import annotations

import argparse

from nanoqwen import __version__
from nanoqwen.cli.flags import Parser, engine_flags, sampling_flags
from nanoqwen.cli.prompt_input import FORMATS

PROG = "nanoqwen"
COMMANDS = ("generate", "chat", "bench", "serve")
DESCRIPTION = (
    "The `nanoqwen` command: generate, chat and bench. `nanoqwen COMMAND --help` for details."
)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):  # no "(default: None/False/[])" noise, nor a switch's
        if action.default is None or action.default == [] or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


GENERATE_HELP = """\
Generates an answer for each prompt and streams it to stdout.

Prompts: each PROMPT argument is one prompt (quote it); --file adds one prompt per line, or
one {"prompt": ...} object per line (no sampling parameter: the flags set them) when the
file is JSONL (--format; auto: a .jsonl name, or a first line that is a JSON object);
`--file -` reads them from stdin. With neither, all of stdin is one prompt; stdin text next
to PROMPT arguments is refused (use --file -). The model's chat template (or
--chat-template) is applied unless --no-chat.

Several prompts run as one batch. Answers print in prompt order, each under a
`### i/N: prompt` header: the answer being printed streams live, later ones are buffered
until their turn. --json prints one JSON object per prompt instead (prompt, text,
prompt_tokens, completion_tokens, finish_reason, stop_reason, stopped_by, ttft_s, total_s,
tok_per_s = completion_tokens / total_s; times count from when the batch starts).

A speed summary goes to stderr. Sampling defaults come from the checkpoint's
generation_config.json, else Qwen2.5-Instruct's (temperature 0.7, top-p 0.8, top-k 20,
repetition penalty 1.05); --temperature 0 gives greedy, reproducible output. With --json,
--logprobs N adds each token's log-probability, rank and N alternatives."""

CHAT_HELP = """\
Interactive multi-turn chat with the model's chat template; answers stream as they are made.
Commands: /reset clears the history, /exit (or Ctrl-D) quits. Ctrl-C during an answer stops
that answer and keeps the session; Ctrl-C at the prompt quits."""


def build_parser(with_bench: bool = False) -> argparse.ArgumentParser:
    """with_bench: the bench command's own flags (nanoqwen/bench/args.py)."""
    parser = Parser(prog=PROG, description=DESCRIPTION, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    engine, sampling = engine_flags(), sampling_flags()

    gen = sub.add_parser(
        "generate",
        parents=[engine, sampling],
        help="generate text for one or more prompts",
        description=GENERATE_HELP,
        formatter_class=_Formatter,
    )
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text")
    gen.add_argument("--file", metavar="F", help="prompts, one a line (or JSONL); - is stdin")
    gen.add_argument(
        "--format",
        choices=FORMATS,
        default="auto",
        help="--file's format (auto: by name or content)",
    )
    gen.add_argument("--no-chat", action="store_true", help="feed prompts as raw text")
    gen.add_argument("--json", action="store_true", help="JSON lines instead of text")
    gen.set_defaults(command_name="generate")

    chat = sub.add_parser(
        "chat",
        parents=[engine, sampling],
        help="interactive chat",
        description=CHAT_HELP,
        formatter_class=_Formatter,
    )
    chat.set_defaults(command_name="chat")

    bench = sub.add_parser(
        "bench",
        help="GPU throughput/latency benchmark (random weights of real Qwen2.5 shapes)",
        description="Benchmarks the engine; see BENCHMARKS.md.",
        formatter_class=_Formatter,
    )
    bench.set_defaults(command_name="bench")

    from nanoqwen.cli import serve_flags as serve_args  # argparse only: no server libraries

    serve = sub.add_parser(
        "serve",
        parents=[engine],
        help="OpenAI-compatible HTTP server (needs the serve extra)",
        description=serve_args.SERVE_HELP,
        formatter_class=_Formatter,
        conflict_handler="resolve",
    )
    serve_args.add_arguments(serve)
    serve.set_defaults(command_name="serve")
    if with_bench:
        from nanoqwen.bench import add_arguments  # its flags only when asked for

        add_arguments(bench)
    return parser
