"""A chat request made ready for the engine: its messages rendered through the checkpoint's
chat template (with the tools, when the model is to see them), and what its answer is
constrained to."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from jinja2.exceptions import TemplateError

from nanoqwen.errors import InvalidInputError
from nanoqwen.runtime.chat.messages import template_messages
from nanoqwen.runtime.chat.response_format import response_format_output
from nanoqwen.runtime.chat.tools import tool_use
from nanoqwen.runtime.sampling.structured import StructuredOutput
from nanoqwen.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class ChatRequest:
    prompt_ids: list[int]
    structured_output: StructuredOutput | None
    tool_names: frozenset[str]  # tools whose calls the answer is read for (none: plain text)


def chat_request(
    tokenizer,
    messages: Any,
    tools: Any = None,
    tool_choice: Any = None,
    parallel_tool_calls: Any = True,
    response_format: Any = None,
    add_generation_prompt: bool = True,
) -> ChatRequest:
    """InvalidInputError, naming the field to blame, for anything the request gets wrong."""
    if tokenizer is None or tokenizer.chat_template is None:
        why = "no tokenizer (random weights)" if tokenizer is None else "no chat template"
        raise InvalidInputError(f"this model has {why}: chat needs one; use plain prompts",
                                param="messages")  # fmt: skip
    rendered = template_messages(messages)
    use = tool_use(tools, tool_choice, parallel_tool_calls)
    fmt = response_format_output(response_format)
    if fmt is not None and use.constraint is not None:
        raise InvalidInputError(
            "response_format and tool_choice both constrain the answer (a JSON format, and a "
            "required tool call): allowed one of them",
            param="response_format",
        )
    try:
        ids = tokenizer.encode_chat(rendered, use.tools, add_generation_prompt)
    except TemplateError as e:
        raise InvalidInputError(f"messages: the chat template refused them: {e}",
                                param="messages") from None  # fmt: skip
    return ChatRequest(ids, fmt or use.constraint, use.call_names)


def constrained(params: SamplingParams, request: ChatRequest) -> SamplingParams:
    """params with the request's constraint (its response_format, or its required tool call)."""
    if request.structured_output is None:
        return params
    if params.structured_output is not None:
        raise InvalidInputError(
            "sampling_params.structured_output and the chat request's response_format or "
            "tool_choice both constrain the answer: allowed one of them",
            param="structured_output",
        )
    return dataclasses.replace(params, structured_output=request.structured_output)


def conversations(messages: Any) -> list[Any]:
    """One conversation (a list of messages) or a list of them, as a list of conversations."""
    if isinstance(messages, list) and messages and isinstance(messages[0], (list, tuple)):
        return list(messages)
    return [messages]
