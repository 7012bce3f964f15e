"""The `nanoqwen` command: generate, chat and bench. `nanoqwen COMMAND --help` for details."""

from __future__ import annotations

import argparse
import os
import sys

from nanoqwen.cli.engine import chat_template, cli_engine_config, load_llm, sampling_params
from nanoqwen.cli.errors import ArgumentError, CLIError, UsageError
from nanoqwen.cli.flags import flag_spelling
from nanoqwen.cli.generate import cmd_generate
from nanoqwen.cli.parser import COMMANDS, PROG, build_parser
from nanoqwen.errors import InvalidInputError, debug, exit_code, one_line


def cmd_chat(args: argparse.Namespace) -> int:
    from nanoqwen.cli.chat import run_chat

    params = sampling_params(args)
    template = chat_template(args)
    llm = load_llm(args, template)
    if llm.tokenizer is None or llm.tokenizer.chat_template is None:
        raise UsageError(
            "this model has no chat template: give one with --chat-template, or use "
            "`nanoqwen generate --no-chat`"
        )
    return run_chat(llm, params, args.system, args.quiet)


def cmd_bench(args: argparse.Namespace) -> int:
    from nanoqwen.bench import run

    return run(args)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from nanoqwen.serve.server import run_server
    except ImportError as e:
        raise CLIError(
            f"`{PROG} serve` needs the serve extra ({e.name or e} is missing): "
            "pip install 'nanoqwen[serve]'"
        ) from None
    template = chat_template(args)  # checked before anything loads
    return run_server(args, cli_engine_config(args), template)


def error_line(e: BaseException) -> tuple[int, str]:
    """The exit status and one-line message for a failure, bad input in flag spelling."""
    message = one_line(e)
    if isinstance(e, InvalidInputError):
        message = flag_spelling(message)
    return exit_code(e), message


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(with_bench=argv[:1] == ["bench"]).parse_args(argv)
        if args.command is None:
            raise UsageError(
                f"no command given: choose generate, chat, bench or serve (see `{PROG} -h`)"
            )
        handlers = {
            "generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench, "serve": cmd_serve
        }  # fmt: skip
        return int(handlers[args.command_name](args) or 0)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `nanoqwen generate ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:
        if debug():
            raise
        code, message = error_line(e)
        hint = ""
        if isinstance(e, ArgumentError):
            command = argv[0] if argv[:1] and argv[0] in COMMANDS else None
            hint = f" (see `{PROG}{' ' + command if command else ''} --help`)"
        print(f"{PROG}: error: {message}{hint}", file=sys.stderr)
        return code
