"""`nanoqwen serve`: load the engine, build the app, run uvicorn on a socket bound here."""

from __future__ import annotations

import argparse
import logging
import socket
import sys

import uvicorn

from nanoqwen.runtime.engine import LLM
from nanoqwen.serve.app import ServerConfig, build_app
from nanoqwen.weights.hub import DEFAULT_MODEL_NAME


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.random_shape:
        return f"random-qwen2.5-{args.random_shape}"
    return args.model or DEFAULT_MODEL_NAME


def load_engine(args: argparse.Namespace) -> LLM:
    from nanoqwen.cli import chat_template, load_llm

    return load_llm(args, None if args.random_shape else chat_template(args))


def bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port} is out of range: allowed 0..65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run_server(args: argparse.Namespace) -> int:
    checks = [
        ("--max-waiting", args.max_waiting, args.max_waiting >= 0, ">= 0"),
        ("--max-request-bytes", args.max_request_bytes, args.max_request_bytes >= 1, ">= 1"),
        ("--stream-interval", args.stream_interval, args.stream_interval >= 1, ">= 1"),
        ("--gil-switch-interval-ms", args.gil_switch_interval_ms,
         args.gil_switch_interval_ms > 0, "> 0"),
    ]  # fmt: skip
    for flag, value, ok, allowed in checks:
        if not ok:
            raise ValueError(f"{flag} {value} is out of range: allowed {allowed}")
    # The engine thread gives the GIL up at every torch call and waits to get it back; while
    # the event loop's thread is busy with hundreds of streams, that wait lasts up to the
    # switch interval, 5 ms by default, per call. A short interval bounds it.
    sys.setswitchinterval(args.gil_switch_interval_ms / 1e3)
    sock = bind(args.host, args.port)  # first, so a taken port fails before the model loads
    llm = load_engine(args)
    name = served_model_name(args)
    config = ServerConfig(
        name, args.api_key, args.max_waiting, args.max_request_bytes, args.stream_interval
    )
    app = build_app(llm, config)
    host, port = sock.getsockname()[:2]
    # Always printed, --quiet or not: with --port 0 it is how a caller learns the port.
    print(f"[nanoqwen] serving {name} on http://{host}:{port}", file=sys.stderr, flush=True)
    level = "warning" if args.quiet else args.log_level
    logging.getLogger("nanoqwen.serve").setLevel(logging.INFO)
    server = uvicorn.Server(uvicorn.Config(app, log_level=level, timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0
