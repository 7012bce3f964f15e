"""OpenAI-style error objects: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from nanoqwen.serve.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("nanoqwen.serve")

# HTTP status -> OpenAI's error type.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_error",
    503: "server_overloaded",
}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    info = ErrorInfo(message=message, type=ERROR_TYPES.get(status, "error"), param=param, code=code)
    return ErrorResponse(error=info)


def error_response(error: APIError) -> JSONResponse:
    body = error_body(error.status, error.message, error.param, error.code)
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(body.model_dump(), status_code=error.status, headers=headers)


def bad_request(e: ValueError) -> APIError:
    """A SamplingParams or prompt check's one-line message, `name=value is out of range: ...`,
    as a 400 naming the parameter."""
    message = " ".join(str(e).split())
    name, sep, _ = message.partition("=")
    return APIError(400, message, param=name if sep and name.isidentifier() else None)


# pydantic names the member of a union that failed: `str`, `list[int]`, ... in loc.
_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list"}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first complaint as one line: `temperature: Input should be a valid number`."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    # Of a union's complaints the deepest names what is wrong: an image part of a message's
    # content is "content.0.type: Input should be 'text'", not "content: ... a valid string".
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    if first.get("type") == "json_invalid":
        why = first.get("ctx", {}).get("error", "parse error")
        return f"the body is not valid JSON ({why})", None
    # loc is ("body", field, index, ...): keep the field path, drop union member tags.
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    path = ".".join(p for p in loc if p not in _UNION_TAGS and "[" not in p)
    if first.get("type") == "missing":
        return f"{path} is missing: it is required", path or None
    if first.get("type") in ("model_attributes_type", "model_type") and not path:
        return "the body must be a JSON object", None
    return f"{path or 'body'}: {first.get('msg', 'invalid value')}", path or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(APIError(400, message, param))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect):
        # The client left while its body was being read: nobody reads an answer, and it is
        # no server error (the soak test's clients do it).
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("request failed")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))
