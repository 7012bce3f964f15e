"""Tokenizer, chat template and EOS ids of a checkpoint directory."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys=False):
    # Matches transformers' override: jinja's own tojson escapes HTML characters.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.chat_template = _load_chat_template(model_dir, cfg)
        self.eos_token_ids = _eos_ids(model_dir, self)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use --no-chat / plain prompts")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        # The template already holds every special token, as in HF's apply_chat_template.
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def _load_chat_template(model_dir: Path, cfg: dict[str, Any]) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t["name"]: t["template"] for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


def _eos_ids(model_dir: Path, tok: Tokenizer) -> frozenset[int]:
    """generation_config.json's eos_token_id (config.json's when it names none), plus the
    tokenizer's eos_token."""
    ids: set[int] = set()
    eos = None
    for name in ("generation_config.json", "config.json"):
        source = model_dir / name
        if eos is None and source.exists():
            eos = json.loads(source.read_text()).get("eos_token_id")
    if isinstance(eos, list):
        ids.update(int(e) for e in eos)
    elif eos is not None:
        ids.add(int(eos))
    if tok.eos_token is not None:
        eos_id = tok.token_to_id(tok.eos_token)
        if eos_id is not None:
            ids.add(eos_id)
    return frozenset(ids)
