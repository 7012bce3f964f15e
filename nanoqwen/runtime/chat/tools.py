"""A chat request's tools and tool_choice, as OpenAI's API takes them, turned into what the
engine does with them: the tools the template shows the model, the constraint on its answer,
and the tools whose calls are read back from it.

tool_choice "none": the model is not shown the tools and its text stays text. "auto" (the
default when tools are given): it is shown them and may call them; its calls are read back
(not constrained, as in vLLM: a model that starts a call may still get the arguments wrong).
"required" or a named function: the answer is constrained (an xgrammar structural tag) to
nothing but calls in Qwen's format, one or more (one without parallel_tool_calls), or one of
the named function, whose arguments are documents of the function's parameter schema."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nanoqwen.errors import InvalidInputError
from nanoqwen.runtime.chat.tool_calls import CLOSE, OPEN
from nanoqwen.runtime.sampling.schema_check import check_json_schema
from nanoqwen.runtime.sampling.structured import StructuredOutput, load_xgrammar
from nanoqwen.validation import a_type, boolean, invalid

# OpenAI's rule for function names.
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolUse:
    tools: list[dict[str, Any]] | None  # for the template; None: no tools section
    constraint: StructuredOutput | None
    call_names: frozenset[str]  # empty: the answer's text stays text


NO_TOOLS = ToolUse(None, None, frozenset())


def tool_use(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = True) -> ToolUse:
    parallel = boolean("parallel_tool_calls", parallel_tool_calls)
    names = _check_tools(tools)
    if not names:
        if tool_choice not in (None, "none"):
            raise InvalidInputError(
                f"tool_choice={tool_choice!r} needs tools: give tools, or leave tool_choice out",
                param="tool_choice",
            )
        return NO_TOOLS
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise invalid("tool_choice", choice, "is unknown",
                          f"{', '.join(CHOICES)} or {{\"type\": \"function\", ...}}")  # fmt: skip
        if choice == "none":
            return NO_TOOLS
        if choice == "auto":
            return ToolUse(list(tools), None, frozenset(names))
    else:
        names, parallel = [_named(choice, names)], False
    constraint = StructuredOutput(structural_tag=_calls_tag(tools, names, parallel))
    return ToolUse(list(tools), constraint, frozenset(names))


def _calls_tag(tools: Sequence[Mapping], names: list[str], parallel: bool) -> str:
    """xgrammar's structural tag for an answer that is nothing but calls of the named
    functions in Qwen2.5's format (one, or with parallel calls one or more on their own
    lines), each call's arguments a document of its function's parameter schema."""
    st = load_xgrammar().structural_tag
    tags = []
    for tool in tools:
        function = tool["function"]
        if function["name"] not in names:
            continue
        # A function without parameters takes none: its arguments are {}, as in OpenAI's API.
        schema = function.get("parameters") or {"type": "object", "properties": {}}
        tags.append(
            st.TagFormat(
                begin=f'{OPEN}\n{{"name": "{function["name"]}", "arguments": ',
                # One space at most where JSON allows any: a model cannot pad a call for ever.
                content=st.JSONSchemaFormat(json_schema=dict(schema), max_whitespace_cnt=1),
                end=f"}}\n{CLOSE}",
            )
        )
    calls = st.TagsWithSeparatorFormat(
        tags=tags, separator="\n", at_least_one=True, stop_after_first=not parallel
    )
    return st.StructuralTag(format=calls).model_dump_json()


def _check_tools(tools: Any) -> list[str]:
    """The function names; InvalidInputError naming the tool to blame."""
    if tools is None:
        return []
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise invalid("tools", tools, f"is {a_type(tools)}", "a list of function tools")
    names: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise invalid(where, tool, "is not a function tool",
                          '{"type": "function", "function": {"name": ...}}')  # fmt: skip
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise invalid(f"{where}.function", function, "is missing", "an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise invalid(f"{where}.function.name", name, "is not a function name",
                          "1 to 64 letters, digits, _ or -")  # fmt: skip
        if name in names:
            raise invalid(f"{where}.function.name", name, "names a second tool",
                          "each name once")  # fmt: skip
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, Mapping):
                raise invalid(f"{where}.function.parameters", parameters,
                              f"is {a_type(parameters)}", "a JSON schema object")  # fmt: skip
            check_json_schema(dict(parameters), f"{where}.function.parameters")
        names.append(name)
    return names


def _named(choice: Any, names: list[str]) -> str:
    allowed = f'{", ".join(CHOICES)} or {{"type": "function", "function": {{"name": ...}}}}'
    function = choice.get("function") if isinstance(choice, Mapping) else None
    if (
        not isinstance(choice, Mapping)
        or choice.get("type") != "function"
        or not isinstance(function, Mapping)
    ):
        raise invalid("tool_choice", choice, "is not a tool choice", allowed)
    name = function.get("name")
    if name not in names:
        raise invalid("tool_choice.function.name", name, "is not one of the tools",
                      ", ".join(names))  # fmt: skip
    return name
