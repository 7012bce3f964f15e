"""The flags that several `nanoqwen` commands share: model and engine, and sampling."""

from __future__ import annotations

import argparse
import functools
import re

from nanoqwen.cli.errors import ArgumentError
from nanoqwen.cli.structured_flags import DESTS, add_structured_flags, structured_spelling
from nanoqwen.runtime.config_flags import add_engine_flags


class Parser(argparse.ArgumentParser):
    """Raises ArgumentError (one line) where argparse prints its usage block and exits."""

    def error(self, message: str):
        raise ArgumentError(message)


def engine_flags() -> argparse.ArgumentParser:
    p = Parser(add_help=False)
    g = p.add_argument_group("model and engine")
    add_engine_flags(g)
    g.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template (a file, or the template text itself) to use instead of "
        "the model's",
    )
    g.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar, engine log or speed summary"
    )
    return p


def _token_id_list(text: str) -> list[int]:
    """--stop-token-ids 151643,151645"""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid token id list: {text!r} (allowed comma-separated integers)"
        ) from None


def sampling_flags() -> argparse.ArgumentParser:
    p = Parser(add_help=False)
    g = p.add_argument_group(
        "sampling (defaults marked * come from the checkpoint's generation_config.json, and "
        "where it names none from Qwen2.5-Instruct's: temperature 0.7, top-p 0.8, top-k 20, "
        "repetition penalty 1.05)"
    )
    g.add_argument(
        "--max-tokens", type=int, default=512, metavar="N", help="new tokens per answer, at most"
    )
    g.add_argument("--temperature", type=float, metavar="T", help="* 0 = greedy (deterministic)")
    g.add_argument("--top-p", type=float, metavar="P", help="* nucleus mass kept; 1 = off")
    g.add_argument(
        "--top-k", type=int, metavar="K", help="* most likely tokens kept; 0 or -1 = off"
    )
    g.add_argument("--min-p", type=float, metavar="P", help="* 0 = off (default 0)")
    g.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        metavar="N",
        help="new tokens before EOS, a stop token or a stop string may end an answer",
    )
    g.add_argument("--repetition-penalty", type=float, metavar="R", help="* 1 = off")
    g.add_argument(
        "--presence-penalty", type=float, default=0.0, metavar="F", help="-2..2; 0 = off"
    )
    g.add_argument(
        "--frequency-penalty", type=float, default=0.0, metavar="F", help="-2..2; 0 = off"
    )
    g.add_argument(
        "--seed", type=int, metavar="N", help="sampling seed, per prompt (default: random)"
    )
    g.add_argument("--stop", action="append", metavar="STR", help="stop at this text (repeatable)")
    g.add_argument(
        "--stop-token-ids",
        type=_token_id_list,
        action="extend",
        metavar="IDS",
        help="stop at these token ids, comma-separated (repeatable)",
    )
    g.add_argument("--ignore-eos", action="store_true", help="go on past EOS, up to --max-tokens")
    g.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help="with --json: each token's log-probability, rank and the N most likely (0..20)",
    )
    g.add_argument("--system", metavar="PROMPT", help="system prompt (chat template only)")
    add_structured_flags(p)
    return p


@functools.cache
def _flag_params() -> tuple[str, ...]:
    """The API names that a flag of the same name sets (block_size: --block-size)."""
    names = []
    for parser in (engine_flags(), sampling_flags()):
        for action in parser._actions:
            if action.dest in DESTS:  # structured_spelling's: not SamplingParams fields
                continue
            if "--" + action.dest.replace("_", "-") in action.option_strings:
                names.append(action.dest)
    return tuple(sorted(names, key=len, reverse=True))


def flag_spelling(message: str) -> str:
    """The library's parameter names as the CLI's flags: 'block_size=3 is ...' becomes
    '--block-size 3 is ...', a bare 'max_model_len' becomes '--max-model-len'."""
    message = structured_spelling(message)
    for name in _flag_params():
        flag = "--" + name.replace("_", "-")
        message = re.sub(rf"(?<![\w./-]){name}=", f"{flag} ", message)
        if "_" in name:  # a plain word like "stop" or "seed" is left alone
            message = re.sub(rf"(?<![\w./-]){name}\b", flag, message)
    return message
