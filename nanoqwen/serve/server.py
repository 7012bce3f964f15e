"""`nanoqwen serve`: bind the socket, start the engine process, run uvicorn on the socket.

Two processes: this one (HTTP, validation, tokenization, streaming) and the engine process
(engine_core.py), so that the engine's steps never wait for this one's Python work."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys

import uvicorn

from nanoqwen.errors import EngineError
from nanoqwen.runtime.config import EngineConfig
from nanoqwen.serve.app import ServerConfig, build_app
from nanoqwen.serve.engine_client import EngineClient
from nanoqwen.serve.model_info import ModelInfo
from nanoqwen.weights.generation_config import request_defaults as checkpoint_defaults
from nanoqwen.weights.hub import DEFAULT_MODEL_NAME, resolve_model
from nanoqwen.weights.tokenizer import Tokenizer


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.random_shape:
        return f"random-qwen2.5-{args.random_shape}"
    return args.model or DEFAULT_MODEL_NAME


def load_tokenizer(config: EngineConfig, template: str | None) -> Tokenizer | None:
    """This process's own tokenizer (None with random weights), chat template included."""
    if config.random_shape:
        return None
    tokenizer = Tokenizer(resolve_model(config.model))
    if template is not None:
        tokenizer.set_chat_template(template, "--chat-template")
    return tokenizer


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


def start_engine(
    args: argparse.Namespace, config: EngineConfig, template: str | None
) -> tuple[EngineClient, ModelInfo]:
    """The tokenizer here, then the engine process; returns once the model is loaded.
    A load failure raises the error `nanoqwen generate` would give for the same flags."""
    tokenizer = load_tokenizer(config, template)

    def terminated(signum, frame):
        raise SystemExit(128 + signum)  # unwinds to the clean-up below, as Ctrl-C does

    engine = EngineClient.launch(config, args.stream_interval)
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        ready = engine.wait_ready()
    except BaseException:  # a load error, Ctrl-C or SIGTERM while loading
        engine.kill()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    defaults = request_defaults(args, config)
    return engine, ModelInfo(tokenizer, ready.max_model_len, ready.vocab_size, defaults)


def request_defaults(args: argparse.Namespace, config: EngineConfig) -> dict[str, float | int]:
    """--generation-config auto: the sampling fields of the checkpoint's
    generation_config.json (weights/generation_config.py); none, or random weights: only
    OpenAI's defaults."""
    if args.generation_config == "none" or config.random_shape:
        return {}
    return checkpoint_defaults(resolve_model(config.model))


def run_server(args: argparse.Namespace, config: EngineConfig, template: str | None) -> int:
    """args: the serve flags (cli/serve_flags.py); config: the engine's; template: the
    --chat-template text, already checked."""
    checks = [
        ("--max-waiting", args.max_waiting, args.max_waiting >= 0, ">= 0"),
        ("--max-request-bytes", args.max_request_bytes, args.max_request_bytes >= 1, ">= 1"),
        ("--stream-interval", args.stream_interval, args.stream_interval >= 1, ">= 1"),
    ]
    for flag, value, ok, allowed in checks:
        if not ok:
            raise ValueError(f"{flag} {value} is out of range: allowed {allowed}")
    sock = bind(args.host, args.port)  # first, so a taken port fails before the model loads
    engine, info = start_engine(args, config, template)
    try:
        name = served_model_name(args)
        settings = ServerConfig(
            name, args.api_key, args.max_waiting, args.max_request_bytes, not args.no_web_ui
        )
        app = build_app(engine, info, settings)
        host, port = sock.getsockname()[:2]
        # Always printed, --quiet or not: with --port 0 it is how a caller learns the port.
        print(f"[nanoqwen] serving {name} on http://{host}:{port}", file=sys.stderr, flush=True)
        level = "warning" if args.quiet else args.log_level
        logging.getLogger("nanoqwen.serve").setLevel(logging.INFO)
        server = uvicorn.Server(uvicorn.Config(app, log_level=level, timeout_graceful_shutdown=5))
        # The engine gone (and with --restart-engine, its successor failed to load): uvicorn
        # stops taking connections, lets the failed requests' responses finish, and this
        # process exits 1 for its supervisor to restart it.
        engine.on_exit = lambda: setattr(server, "should_exit", True)
        engine.restart_engine = args.restart_engine
        server.run(sockets=[sock])
    finally:
        engine.shutdown()  # the app's lifespan did it already, unless uvicorn failed first
    if engine.exit_message is not None:
        raise EngineError(engine.exit_message)
    return 0
