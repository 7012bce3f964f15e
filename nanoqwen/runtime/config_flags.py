"""EngineConfig's command-line flags, made from its fields: `nanoqwen generate | chat | serve`
and `nanoqwen bench` add them, and read an EngineConfig back from the parsed flags."""

from __future__ import annotations

import argparse
from dataclasses import Field, fields
from typing import Any

from nanoqwen.runtime.config import EngineConfig

_METAVARS = {int: "N", float: "F"}


def flag_name(f: Field) -> str | None:
    """The flag that sets field f (--block-size for block_size), or None where none does."""
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def add_engine_flags(
    group: argparse._ActionsContainer,
    defaults: dict[str, Any] | None = None,
    helps: dict[str, str] | None = None,
    names: tuple[str, ...] | None = None,
) -> None:
    """One flag per EngineConfig field that has one, or for the fields named (random_shape
    has a flag only where a command adds it); defaults and helps override a field's default
    and help text for this command."""
    defaults, helps = defaults or {}, helps or {}
    for f in fields(EngineConfig):
        flag = flag_name(f)
        if names is not None:
            if f.name not in names:
                continue
            flag = flag or "--" + f.name.replace("_", "-")
        elif flag is None:
            continue
        meta = f.metadata
        default = defaults.get(f.name, meta.get("cli_default", f.default))
        help = helps.get(f.name, meta["help"])
        if isinstance(f.default, bool):
            # A flag switches the setting away from its default (--enforce-eager,
            # --no-prefix-caching).
            action = "store_false" if f.default else "store_true"
            group.add_argument(flag, dest=f.name, action=action, help=help)
            continue
        kind = meta.get("type", str if f.default is None else type(f.default))
        group.add_argument(
            flag,
            dest=f.name,
            type=kind,
            default=default,
            choices=meta.get("choices"),
            metavar=None if "choices" in meta else meta.get("metavar", _METAVARS.get(kind)),
            help=help,
        )


def engine_config(args: argparse.Namespace, **settings: Any) -> EngineConfig:
    """The EngineConfig of the parsed flags; settings: the fields a command sets itself."""
    given = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**(given | settings))
