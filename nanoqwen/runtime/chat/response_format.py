"""OpenAI's response_format as a StructuredOutput: {"type": "text"} (no constraint),
{"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name", "schema", ...}}."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nanoqwen.errors import InvalidInputError
from nanoqwen.runtime.sampling.structured import StructuredOutput
from nanoqwen.validation import a_type, invalid

TYPES = ("text", "json_object", "json_schema")


def response_format_output(response_format: Any) -> StructuredOutput | None:
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise invalid("response_format", response_format, f"is {a_type(response_format)}",
                      '{"type": "text" | "json_object" | "json_schema", ...}')  # fmt: skip
    kind = response_format.get("type")
    if kind not in TYPES:
        raise invalid("response_format.type", kind, "is unknown", ", ".join(TYPES))
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise invalid("response_format.json_schema", spec, "is missing",
                      'an object with "name" and "schema"')  # fmt: skip
    schema = spec.get("schema")
    if schema is None:
        # OpenAI's schema field is optional: without one, any JSON object.
        return StructuredOutput(json_object=True)
    if not isinstance(schema, Mapping):
        raise invalid("response_format.json_schema.schema", schema, f"is {a_type(schema)}",
                      "a JSON schema object")  # fmt: skip
    try:
        return StructuredOutput(json=dict(schema))
    except InvalidInputError as e:  # named as the request names it
        message = e.message.replace("structured_output.json", "response_format.json_schema.schema")
        raise InvalidInputError(message, param="response_format") from None
