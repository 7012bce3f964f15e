"""The structured-output flags of `generate` and `chat` (--json-schema, --json-object, --regex,
--grammar): what SamplingParams.structured_output they ask for, and the engine's messages
about that field in their spelling."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from nanoqwen.validation import json_object, read_text

# StructuredOutput's fields, and the flag that sets each.
FLAGS = {
    "json": "--json-schema",
    "json_object": "--json-object",
    "regex": "--regex",
    "grammar": "--grammar",
}
# The flags by argparse dest: not API parameter names, so flag_spelling leaves them out.
DESTS = {flag[2:].replace("-", "_"): flag for flag in FLAGS.values()}


class _OneOf(argparse.Action):
    """Refuses a second structured-output flag as a mutually exclusive group would, in its
    words. Not a real group: when argparse copies the shared flags from their parent parser
    into generate and chat, a group nested in an argument group leaves it (and its --help
    section)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        for dest, flag in DESTS.items():
            if dest != self.dest and getattr(namespace, dest, None) not in (None, False):
                raise argparse.ArgumentError(self, f"not allowed with argument {flag}")
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def add_structured_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("structured output (one of)")
    g.add_argument(
        "--json-schema",
        action=_OneOf,
        metavar="SCHEMA",
        help="the answer is JSON that validates against this JSON schema (a file, or the "
        "schema's JSON text itself)",
    )
    g.add_argument(
        "--json-object",
        action=_OneOf,
        nargs=0,
        const=True,
        default=False,
        help="the answer is any JSON object (not generate's --json: that is the output format)",
    )
    g.add_argument(
        "--regex",
        action=_OneOf,
        metavar="PATTERN",
        help="the answer matches this regular expression",
    )
    g.add_argument(
        "--grammar",
        action=_OneOf,
        metavar="GRAMMAR",
        help="the answer follows this EBNF grammar (xgrammar's GBNF dialect, root rule "
        "`root`): a file, or the grammar text",
    )


def structured_output(args: argparse.Namespace) -> dict[str, Any] | None:
    """SamplingParams.structured_output from the flags, files read and checked here, before
    the model loads; None when no flag asks for it."""
    if args.json_schema is not None:
        return {"json": _json_schema(args.json_schema)}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.grammar is not None:
        return {"grammar": _grammar(args.grammar)}
    return None


def _json_schema(value: str) -> dict[str, Any]:
    if value.lstrip().startswith("{"):
        text, label = value, "--json-schema"
    else:
        text, label = read_text(value, "--json-schema"), f"--json-schema {value}"
    return json_object(text, label)


def _grammar(value: str) -> str:
    # As --chat-template: text with a rule in it that names no file is the grammar itself.
    if "::=" in value and not Path(value).exists():
        return value
    return read_text(value, "--grammar")


def structured_spelling(message: str) -> str:
    """'structured_output.json cannot be compiled' as '--json-schema cannot be compiled',
    'structured_output.regex=...' as '--regex ...', and a place inside the schema,
    'structured_output.json.properties.age ...', as "--json-schema's properties.age ..."."""

    def flag(m: re.Match) -> str:
        return FLAGS[m[1]] + {"=": " ", ".": "'s "}.get(m[2] or "", "")

    # json_object before json: the longer name first, \b keeps json from matching inside it.
    # A dot is a path only when more follows it, not where it ends a sentence.
    return re.sub(
        r"(?<![\w./-])structured_output\.(json_object|json|regex|grammar)\b(=|\.(?=\S))?",
        flag,
        message,
    )
