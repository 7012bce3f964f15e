"""The chat page: `GET /` and its static files under `/web/` (nanoqwen/serve/web/)."""

from __future__ import annotations

import mimetypes
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

WEB_DIR = Path(__file__).resolve().parent / "web"

# Model output is sanitized before it is shown; this is the second wall: only the page's own
# scripts run, and nothing (a markdown image, say) loads from or talks to another origin.
PAGE_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)

# The system's MIME table may lack these or (Windows' registry) name .js text/plain, which
# browsers refuse to run under nosniff.
mimetypes.add_type("text/javascript", ".js")
mimetypes.add_type("text/css", ".css")


def add_web_routes(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        headers = {
            "Content-Security-Policy": PAGE_POLICY,
            "X-Content-Type-Options": "nosniff",
            "Cache-Control": "no-cache",
        }
        return FileResponse(WEB_DIR / "index.html", media_type="text/html", headers=headers)

    app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")
