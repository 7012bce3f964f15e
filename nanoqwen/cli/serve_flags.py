"""The `nanoqwen serve` flags beyond the engine flags shared with `generate`."""

from __future__ import annotations

import argparse

from nanoqwen.runtime.config_flags import add_engine_flags

SERVE_HELP = """\
Serves the model over HTTP with OpenAI's API: POST /v1/completions and /v1/chat/completions
(streaming as server-sent events), GET /v1/models, /health, /metrics (Prometheus),
/version, and a chat page at /. Requests join the running batch as they arrive (continuous
batching). Request fields the client leaves out take OpenAI's defaults (temperature 1,
top_p 1; max_tokens 16 for completions, the rest of the context for chat)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    g.add_argument(
        "--api-key", metavar="KEY", help="require `Authorization: Bearer KEY` on /v1 routes"
    )
    g.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name clients send (default: --model as given, or the default "
        "checkpoint's name)",
    )
    g.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        metavar="N",
        help="503 for a request that would make more than N sequences wait for a slot "
        "(backpressure; with none waiting, any request is taken)",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=4 << 20,
        metavar="N",
        help="larger request bodies get 413",
    )
    g.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        metavar="N",
        help="stream tokens N at a time (the first and last at once): fewer, larger chunks "
        "for the HTTP process to write when hundreds of clients stream",
    )
    g.add_argument(
        "--restart-engine",
        action="store_true",
        help="when the engine process dies, start a new one and keep serving (requests in "
        "flight fail, /health answers 503 until it is loaded); without it the server exits 1 "
        "for its supervisor to restart",
    )
    g.add_argument(
        "--no-web-ui",
        action="store_true",
        help="serve no chat page at / (GET / is then a 404 like any unknown path)",
    )
    g.add_argument(
        "--generation-config",
        choices=("auto", "none"),
        default="auto",
        help="auto: sampling fields a request leaves out take the checkpoint's "
        "generation_config.json values (as `nanoqwen generate` does); none: OpenAI's defaults",
    )
    g.add_argument("--log-level", default="info", help="uvicorn's log level")
    add_engine_arguments(p)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Beyond the engine flags shared with `generate` (also used by the serving benchmark's
    --offline)."""
    add_engine_flags(p.add_argument_group("engine"), names=("random_shape",))
