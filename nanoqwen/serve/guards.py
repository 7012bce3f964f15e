"""ASGI middleware that turns requests away before any route runs: a missing or wrong API
key (401) and a body over the size limit (413)."""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from nanoqwen.serve.errors import APIError, error_response

# Open without a key, as in vLLM: probes and scrapers carry none. The chat page and its
# files are open too: the page asks for the key and sends it with its API calls.
OPEN_PATHS = ("/health", "/metrics", "/version", "/")
OPEN_PREFIX = "/web/"


def is_open(path: str) -> bool:
    # No `..` under the prefix: the router does not collapse it, but nothing should rely on it.
    return path in OPEN_PATHS or (path.startswith(OPEN_PREFIX) and ".." not in path)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class APIKeyGuard:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not is_open(scope["path"]):
            given = _header(scope, b"authorization") or b""
            # Constant time, so the key cannot be guessed byte by byte from response times.
            if not hmac.compare_digest(given, self.expected):
                message = "invalid or missing API key: send the header `Authorization: Bearer KEY`"
                await error_response(APIError(401, message))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is over the limit of {self.max_bytes} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self._too_large())(scope, receive, send)
            return
        received = 0

        async def counting_receive():
            # A chunked body declares no length: count it as it comes.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, counting_receive, send)
