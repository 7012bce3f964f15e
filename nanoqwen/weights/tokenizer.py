"""Tokenizer, chat template and EOS ids of a checkpoint directory."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.exceptions import TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from nanoqwen.errors import InvalidInputError
from nanoqwen.validation import invalid, read_json_object, read_text, token_ids
from nanoqwen.weights.hub import ModelNotFoundError


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys=False):
    # Matches transformers' override: jinja's own tojson escapes HTML characters.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _token_text(cfg: dict[str, Any], key: str, source: Path) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken object."""
    value = cfg.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise invalid(f"{source}: {key}", cfg.get(key), "is not a token", "a string or null")
    return value


def _environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def compile_chat_template(text: str, source: str) -> Template:
    """InvalidInputError naming source (a file, or --chat-template) for a template that does
    not parse."""
    try:
        return _environment().from_string(text)
    except TemplateSyntaxError as e:
        raise InvalidInputError(
            f"{source} holds an invalid chat template (line {e.lineno}: {e.message}): "
            "allowed a Jinja template"
        ) from None


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ModelNotFoundError(f"{model_dir} has no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            detail = (str(e).splitlines() or [type(e).__name__])[0][:120]
            raise InvalidInputError(
                f"{path} is not a tokenizer the tokenizers library can load ({detail})"
            ) from None
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = read_json_object(cfg_path) if cfg_path.exists() else {}
        self.eos_token = _token_text(cfg, "eos_token", cfg_path)
        self.bos_token = _token_text(cfg, "bos_token", cfg_path)
        template, source = _load_chat_template(model_dir, cfg)
        self.set_chat_template(template, source)
        self.eos_token_ids = _eos_ids(model_dir, self)

    @classmethod
    def from_parts(
        cls, tok: HFTokenizer, cfg: dict[str, Any], eos_token_ids: set[int], source: str
    ) -> Tokenizer:
        """A tokenizer from objects instead of files (a GGUF's metadata); cfg is
        tokenizer_config.json's content, source names it in errors."""
        self = cls.__new__(cls)
        self._tok = tok
        self.eos_token = _token_text(cfg, "eos_token", Path(source))
        self.bos_token = _token_text(cfg, "bos_token", Path(source))
        self.set_chat_template(cfg.get("chat_template"), source)
        self.eos_token_ids = frozenset(eos_token_ids)
        return self

    def set_chat_template(self, text: str | None, source: str) -> None:
        """Replaces the chat template (None: no template); source names it in errors."""
        self.chat_template = text
        self._template = compile_chat_template(text, source) if text is not None else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Every token as the tokenizer stores it (byte-level text), added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation as the model reads it; with tools, the template's tools section
        (Qwen2.5's system prompt lists them)."""
        if self._template is None:
            raise InvalidInputError(
                "this model has no chat template: allowed plain prompts (--no-chat), "
                "or give one with --chat-template"
            )
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        # The template already holds every special token, as in HF's apply_chat_template.
        text = self.render_chat(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False)


def _load_chat_template(model_dir: Path, cfg: dict[str, Any]) -> tuple[str | None, str]:
    """(the chat template or None, the file it comes from)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return read_text(jinja), str(jinja)
    source = str(model_dir / "tokenizer_config.json")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        if not all(
            isinstance(t, dict)
            and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str)
            for t in template
        ):
            raise invalid(
                f"{source}: chat_template",
                template,
                "is invalid",
                'a string or [{"name", "template"}]',
            )
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is not None and not isinstance(template, str):
        raise invalid(f"{source}: chat_template", template, "is not a string", "a Jinja template")
    return template, source


def _eos_ids(model_dir: Path, tok: Tokenizer) -> frozenset[int]:
    """generation_config.json's eos_token_id (config.json's when it names none), plus the
    tokenizer's eos_token."""
    ids: set[int] = set()
    eos = None
    for name in ("generation_config.json", "config.json"):
        source = model_dir / name
        if eos is None and source.exists():
            eos = read_json_object(source).get("eos_token_id")
            if eos is not None:
                ids.update(
                    token_ids(f"{source}: eos_token_id", eos if isinstance(eos, list) else [eos])
                )
    if tok.eos_token is not None:
        eos_id = tok.token_to_id(tok.eos_token)
        if eos_id is not None:
            ids.add(eos_id)
    return frozenset(ids)
