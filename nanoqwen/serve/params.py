"""API requests -> prompt token ids and SamplingParams, with the checks that make a 400.

Every check raises APIError(400) with one line naming the field; range checks are
SamplingParams' own (its ValueError message, passed through)."""

from __future__ import annotations

from pydantic import BaseModel

from nanoqwen.errors import InvalidInputError
from nanoqwen.runtime.chat.request import ChatRequest
from nanoqwen.runtime.chat.request import chat_request as runtime_chat_request
from nanoqwen.runtime.logprobs import MAX_LOGPROBS
from nanoqwen.runtime.sampling.structured import StructuredOutput
from nanoqwen.runtime.sampling_params import SamplingParams
from nanoqwen.serve.echo import Echo, EchoPrompt
from nanoqwen.serve.errors import APIError, bad_request
from nanoqwen.serve.model_info import ModelInfo
from nanoqwen.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

MAX_N = 128
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _unsupported(name: str, value, default_ok: bool) -> None:
    if not default_ok:
        raise APIError(400, f"{name}={value!r} is not supported by this server", param=name)


def completion_prompts(req: CompletionRequest, info: ModelInfo) -> list[list[int]]:
    """The prompt field as a list of token id lists: a string, token ids, or a list of either."""
    _unsupported("suffix", req.suffix, req.suffix is None)
    _unsupported("best_of", req.best_of, req.best_of in (None, req.n))
    batch = prompt_batch(req)
    if not batch:
        message = "prompt is empty: give a string, token ids, or a list of them"
        raise APIError(400, message, "prompt")
    if isinstance(batch[0], str) and info.tokenizer is None:
        message = "this server has no tokenizer (random weights): send prompts as token ids"
        raise APIError(400, message, "prompt")
    try:
        return [_nonempty(info.encode(p)) for p in batch]
    except ValueError as e:  # InvalidInputError: already "prompt=... what is allowed"
        raise APIError(400, str(e), "prompt") from None


def prompt_batch(req: CompletionRequest) -> list[str | list[int]]:
    """The prompt field as a list of prompts, each a string or token ids."""
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def chat_request(req: ChatCompletionRequest, info: ModelInfo) -> ChatRequest:
    """The prompt, its constraint (response_format, or a required tool call) and whether tool
    calls are read back; the messages and tools are checked by runtime/chat/."""
    if req.echo:
        raise APIError(400, "echo=True is for /v1/completions only", "echo")
    if not req.messages:
        raise APIError(400, "messages is empty: at least one message is needed", "messages")
    tok = info.tokenizer
    if tok is None or tok.chat_template is None:
        why = "no tokenizer (random weights)" if tok is None else "no chat template"
        raise APIError(400, f"this model has {why}: use /v1/completions", "messages")
    if req.structured_outputs is not None and (req.response_format or req.tools):
        message = "structured_outputs goes with neither response_format nor tools: allowed one"
        raise APIError(400, message, "structured_outputs")
    try:
        chat = runtime_chat_request(
            tok,
            dump_models(req.messages),
            tools=dump_models(req.tools),
            tool_choice=dump_models(req.tool_choice),
            parallel_tool_calls=req.parallel_tool_calls,
            response_format=req.response_format,
        )
    except InvalidInputError as e:
        raise APIError(400, e.message, e.param) from None
    _nonempty(chat.prompt_ids)
    return chat


def dump_models(value):
    """Request models as the plain values runtime/chat/ checks (unset fields left out)."""
    if isinstance(value, list):
        return [dump_models(v) for v in value]
    return value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value


def structured_output(req: SamplingFields) -> StructuredOutput | None:
    """vLLM's structured_outputs extension field."""
    try:
        return StructuredOutput.of(req.structured_outputs)
    except InvalidInputError as e:
        raise APIError(400, e.message, "structured_outputs") from None


def _nonempty(ids: list[int]) -> list[int]:
    if not ids:
        raise APIError(400, "prompt is empty: at least one token is needed", "prompt")
    return ids


def sampling_params(
    req: SamplingFields,
    prompt_len: int,
    info: ModelInfo,
    max_tokens: int | None,
    logprobs: int | None,
    constraint: StructuredOutput | None = None,
    prompt_logprobs: int | None = None,
) -> list[SamplingParams]:
    """One SamplingParams per choice of one prompt (n of them): choice j of a seeded request
    gets seed + j, so the n samples differ and each is reproducible.

    max_tokens None: /v1/completions' 16, or for chat what the context has room for."""
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n={req.n} is out of range: allowed 1..{MAX_N}", "n")
    limit = info.max_model_len
    if prompt_len >= limit:
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens: allowed at most {limit - 1} "
            f"(the model's context length is {limit} tokens)",
            "prompt" if isinstance(req, CompletionRequest) else "messages",
        )
    if max_tokens is None:
        is_completion = isinstance(req, CompletionRequest)
        room = limit - prompt_len
        max_tokens = min(COMPLETIONS_DEFAULT_MAX_TOKENS, room) if is_completion else room
    elif max_tokens >= 1 and prompt_len + max_tokens > limit:
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}: together "
            f"{prompt_len + max_tokens}, over the model's context length of {limit} tokens",
            "max_tokens",
        )
    vocab = info.vocab_size
    bad_ids = [t for t in req.stop_token_ids or [] if not 0 <= t < vocab]
    if bad_ids:
        raise APIError(
            400,
            f"stop_token_ids: token id {bad_ids[0]} is out of range: allowed 0..{vocab - 1}",
            "stop_token_ids",
        )

    defaults = info.sampling_defaults

    def pick(name: str, openai_default):
        value = getattr(req, name)
        return defaults.get(name, openai_default) if value is None else value

    top_k = pick("top_k", -1)
    try:
        params = [
            SamplingParams(
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=-1 if top_k == 0 else top_k,
                min_p=pick("min_p", 0.0),
                repetition_penalty=pick("repetition_penalty", 1.0),
                presence_penalty=pick("presence_penalty", 0.0),
                frequency_penalty=pick("frequency_penalty", 0.0),
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                seed=None if req.seed is None else req.seed + j,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_output=constraint,
                logit_bias=req.logit_bias,
            )
            for j in range(req.n)
        ]
    except ValueError as e:  # InvalidInputError subclasses ValueError too
        raise bad_request(e) from None
    past = [t for t in params[0].logit_bias or () if t >= vocab]
    if past:
        message = f"logit_bias: token id {past[0]} is out of range: allowed 0..{vocab - 1}"
        raise APIError(400, message, "logit_bias")
    return params


def completion_echo(
    req: CompletionRequest, prompts: list[list[int]], info: ModelInfo
) -> tuple[Echo | None, int | None]:
    """echo's prompts (None without echo) and the max_tokens the engine runs with."""
    if not req.echo:
        return None, req.max_tokens
    tok = info.tokenizer

    def text(given: str | list[int], ids: list[int]) -> str:
        if isinstance(given, str):
            return given
        return tok.decode(ids, False) if tok else ""

    echoed = [EchoPrompt(text(p, ids), ids) for p, ids in zip(prompt_batch(req), prompts)]
    prompt_only = req.max_tokens == 0
    return Echo(echoed, req.n, prompt_only), 1 if prompt_only else req.max_tokens


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        message = f"top_logprobs={req.top_logprobs} is out of range: allowed 0..{MAX_LOGPROBS}"
        raise APIError(400, message, "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
