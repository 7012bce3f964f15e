"""The FastAPI app: OpenAI-compatible routes over the engine process, plus health and metrics."""

from __future__ import annotations

import asyncio
import functools
import gc
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from nanoqwen import __version__
from nanoqwen.serve import params as P
from nanoqwen.serve import responses as R
from nanoqwen.serve import tokenization as T
from nanoqwen.serve.chat_responses import chat_response, chat_stream
from nanoqwen.serve.engine_client import EngineClient
from nanoqwen.serve.errors import APIError, install_error_handlers
from nanoqwen.serve.generation import ClientDisconnected, Generation
from nanoqwen.serve.guards import APIKeyGuard, BodySizeLimit
from nanoqwen.serve.metrics import ServingMetrics
from nanoqwen.serve.model_info import ModelInfo
from nanoqwen.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
)
from nanoqwen.serve.web_routes import add_web_routes

Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The body as `model`, parsed and checked in one pass of pydantic's own JSON parser
    (a FastAPI body parameter goes through json.loads and the dependency machinery: ~1.5x
    the CPU per request with a 562-token prompt). Errors go to the same handler as FastAPI's
    (pydantic's JSON mode names a list an "array" in them)."""
    body = await request.body()
    content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if not (content_type == "application/json" or content_type.endswith("+json")):
        # As FastAPI has it: the body is JSON only when the request says so.
        raise APIError(400, "the body must be a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in e.errors()]
        raise RequestValidationError(errors, body=body) from None


def body_schema(model: type[BaseModel]) -> dict:
    """The request body's schema for /docs, as FastAPI writes it for a body parameter."""
    return {
        "requestBody": {
            "content": {"application/json": {"schema": model.model_json_schema()}},
            "required": True,
        }
    }


def freeze_heap() -> None:
    """Moves everything allocated so far (modules, torch, FastAPI's routes: ~200,000 objects)
    out of the garbage collector's sight: a full collection then walks only what requests
    made instead of taking ~100-150 ms, which would stall the burst it fell into."""
    gc.collect()
    gc.freeze()


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_waiting: int = 1024  # more sequences waiting than this: new requests get a 503
    max_body_bytes: int = 4 << 20
    web_ui: bool = True  # the chat page at /


def build_app(engine: EngineClient, info: ModelInfo, config: ServerConfig) -> FastAPI:
    """The routes over a started engine; the app's lifespan connects the engine's outputs to
    the event loop and shuts the engine down at the end."""
    metrics = ServingMetrics(config.model_name)
    engine.metrics = metrics
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        freeze_heap()
        yield
        engine.shutdown()

    app = FastAPI(title="nanoqwen", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    install_error_handlers(app)
    # The last added runs first: the key is checked before the body is read.
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    if config.api_key is not None:
        app.add_middleware(APIKeyGuard, api_key=config.api_key)

    tok = info.tokenizer

    def token_text(token_id: int) -> str:
        if tok is None:
            return f"token_id:{token_id}"
        return tok.decode([token_id], skip_special_tokens=False)

    def check_model(req: SamplingFields | TokenizeRequest | DetokenizeRequest) -> None:
        if req.model is not None and req.model != config.model_name:
            raise APIError(
                404,
                f"the model `{req.model}` does not exist: this server serves `{config.model_name}`",
                param="model",
                code="model_not_found",
            )

    def check_capacity(gen: Generation) -> None:
        if not engine.alive:
            raise APIError(500, f"the engine failed: {engine.exit_message}")
        # An idle queue takes any request, so one with many choices is not refused for ever.
        waiting = engine.num_waiting
        if waiting and waiting + gen.num_choices > config.max_waiting:
            raise APIError(
                503,
                f"the server is overloaded: {waiting} requests wait "
                f"(at most {config.max_waiting}); retry later",
            )

    async def respond(request: Request, gen: Generation, req: SamplingFields, stream, whole):
        check_capacity(gen)
        if req.stream:  # the stream starts the generation when the response starts
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = stream(gen, config.model_name, token_text, req.return_token_ids, include_usage)
            return StreamingResponse(
                events,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        gen.start()
        try:
            outputs = await gen.collect(request)
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it
        return whole(gen, outputs, config.model_name, token_text, req.return_token_ids)

    @app.post("/v1/completions", response_model=None, openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request):
        req = await parse_body(request, CompletionRequest)
        check_model(req)
        prompts = P.completion_prompts(req, info)
        constraint = P.structured_output(req)
        echo, max_tokens = P.completion_echo(req, prompts, info)
        prompt_logprobs = req.logprobs if echo is not None else None
        params = [
            P.sampling_params(
                req, len(ids), info, max_tokens, req.logprobs, constraint, prompt_logprobs
            )  # fmt: skip
            for ids in prompts
        ]
        gen = Generation(engine, prompts, params)
        gen.echo = echo
        return await respond(request, gen, req, R.completion_stream, R.completion_response)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        openapi_extra=body_schema(ChatCompletionRequest),
    )
    async def chat_completions(request: Request):
        req = await parse_body(request, ChatCompletionRequest)
        check_model(req)
        chat = P.chat_request(req, info)
        logprobs = P.chat_logprobs(req)
        constraint = chat.structured_output or P.structured_output(req)
        prompt = chat.prompt_ids
        max_tokens = P.chat_max_tokens(req)
        params = P.sampling_params(req, len(prompt), info, max_tokens, logprobs, constraint)
        gen = Generation(engine, [prompt], [params])
        stream = functools.partial(chat_stream, tool_names=chat.tool_names)
        whole = functools.partial(chat_response, tool_names=chat.tool_names)
        return await respond(request, gen, req, stream, whole)

    @app.post("/tokenize", openapi_extra=body_schema(TokenizeRequest))
    async def tokenize(request: Request) -> TokenizeResponse:
        req = await parse_body(request, TokenizeRequest)
        check_model(req)
        return T.tokenize(req, info)

    @app.post("/detokenize", openapi_extra=body_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> DetokenizeResponse:
        req = await parse_body(request, DetokenizeRequest)
        check_model(req)
        return T.detokenize(req, info)

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(id=config.model_name, created=started, max_model_len=info.max_model_len)
        return ModelList(data=[card])

    @app.get("/health")
    async def health():
        if not engine.alive:
            why = engine.exit_message or "the engine process is not running"
            return JSONResponse({"status": why}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    if config.web_ui:
        add_web_routes(app)
    return app
