"""The engine and the sampling parameters that `nanoqwen` flags describe."""

from __future__ import annotations

import argparse
from pathlib import Path

from nanoqwen.cli.structured_flags import structured_output
from nanoqwen.runtime.config import EngineConfig
from nanoqwen.runtime.config_flags import engine_config
from nanoqwen.runtime.engine import LLM
from nanoqwen.runtime.sampling_params import SamplingParams
from nanoqwen.validation import read_text
from nanoqwen.weights.generation_config import FIELDS, sampling_defaults
from nanoqwen.weights.hub import resolve_model
from nanoqwen.weights.tokenizer import compile_chat_template


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """From the flags, and the checkpoint's generation_config.json for those not given."""
    try:
        defaults = sampling_defaults(resolve_model(args.model))
    except (ValueError, FileNotFoundError):
        defaults = sampling_defaults(None)  # loading the model reports what is wrong
    given = {k: getattr(args, k) for k in FIELDS if getattr(args, k) is not None}
    chosen = {"min_p": 0.0} | defaults | given
    return SamplingParams(
        temperature=chosen["temperature"],
        top_p=chosen["top_p"],
        top_k=-1 if chosen["top_k"] == 0 else chosen["top_k"],
        min_p=chosen["min_p"],
        repetition_penalty=chosen["repetition_penalty"],
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        stop=args.stop,
        stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        logprobs=args.logprobs,
        structured_output=structured_output(args),
    )


def chat_template(args: argparse.Namespace) -> str | None:
    """--chat-template's text, checked before the model loads: a file, else the text itself
    when it looks like a template."""
    value = args.chat_template
    if value is None:
        return None
    if not Path(value).exists() and ("{{" in value or "{%" in value):
        text, source = value, "--chat-template"
    else:
        text, source = read_text(value, "--chat-template"), f"--chat-template {value}"
    compile_chat_template(text, source)
    return text


def load_llm(args: argparse.Namespace, template: str | None = None) -> LLM:
    """The engine the flags describe (`serve` and its benchmark add --random-shape)."""
    llm = LLM(config=cli_engine_config(args))
    if template is not None:
        llm.tokenizer.set_chat_template(template, "--chat-template")
    return llm


def cli_engine_config(args: argparse.Namespace) -> EngineConfig:
    """--quiet also silences the engine's log; --random-shape stands for --model."""
    random_shape = getattr(args, "random_shape", None)
    model = None if random_shape else args.model
    return engine_config(args, model=model, random_shape=random_shape, progress=not args.quiet)
