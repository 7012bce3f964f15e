"""`nanoqwen serve`: an OpenAI-compatible HTTP server with continuous batching.

Needs the `serve` extra (FastAPI, uvicorn, prometheus-client). args.py imports none of it,
so the command line can be built without them."""
