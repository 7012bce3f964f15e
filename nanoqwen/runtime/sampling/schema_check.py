"""A JSON schema checked before it is compiled into a grammar: one that is not a schema by the
JSON Schema meta-schema, or that uses a keyword the grammar engine would not enforce, is
refused with the path of the part to blame, so no document is ever generated that the
schema rejects (xgrammar would skip such keywords with at most a warning on stderr)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from nanoqwen.errors import InvalidInputError

# keyword -> why it cannot be honoured while decoding; found by compiling a schema with each
# and checking which violating documents the grammar still accepts (xgrammar 0.2.9).
UNSUPPORTED = {
    "not": "a negated schema",
    "if": "conditional schemas (if/then/else)",
    "then": "conditional schemas (if/then/else)",
    "else": "conditional schemas (if/then/else)",
    "dependentRequired": "dependent requirements",
    "dependentSchemas": "dependent schemas",
    "dependencies": "dependent requirements",
    "contains": "array contains",
    "minContains": "array contains",
    "maxContains": "array contains",
    "patternProperties": "properties matched by pattern",
    "propertyNames": "constraints on property names",
}
# Keywords whose value is one schema, a list of them, or a mapping of names to them.
_ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
        "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")  # fmt: skip
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def check_json_schema(schema: Any, where: str) -> None:
    """InvalidInputError naming `where` and the path inside the schema when it is not a valid
    JSON schema or asks for something the grammar engine cannot enforce."""
    try:
        import jsonschema
    except ImportError:
        raise InvalidInputError(
            f"{where}: checking a JSON schema needs jsonschema, which is not installed: "
            "pip install 'nanoqwen[structured]'",
            param=where,
        ) from None
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = _path(where, list(e.absolute_path))
        raise InvalidInputError(
            f"{path} is not a valid JSON schema: {_one_line(e.message)}", param=where
        ) from None
    found = next(_unsupported(schema, []), None)
    if found is not None:
        path, problem = found
        raise InvalidInputError(
            f"{_path(where, path)}: {problem} cannot be enforced while decoding (the grammar "
            "engine has no way to honour it); remove it or check the output afterwards",
            param=where,
        )


def _unsupported(schema: Any, path: list) -> Iterator[tuple[list, str]]:
    if not isinstance(schema, dict):
        return
    for key, why in UNSUPPORTED.items():
        if key in schema:
            yield [*path, key], f"`{key}` ({why})"
    if schema.get("uniqueItems") is True:
        yield [*path, "uniqueItems"], "`uniqueItems` (items that differ from each other)"
    if len(schema.get("allOf") or []) > 1:
        yield [*path, "allOf"], "`allOf` with more than one schema"
    types = schema.get("type")
    if "multipleOf" in schema and types != "integer":
        yield [*path, "multipleOf"], "`multipleOf` on a non-integer number"
    for key in _ONE:
        yield from _unsupported(schema.get(key), [*path, key])
    for key in _LIST:
        for i, sub in enumerate(schema.get(key) or []):
            yield from _unsupported(sub, [*path, key, i])
    for key in _MAP:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield from _unsupported(sub, [*path, key, name])


def _path(where: str, parts: list) -> str:
    return where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 200 else text[:197] + "..."
