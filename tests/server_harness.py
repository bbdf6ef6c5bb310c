"""Run the server in-process on a free loopback port, for tests."""

from __future__ import annotations

import threading
from contextlib import contextmanager

from kvstrata.bench.redis_server import free_port
from kvstrata.bench.serve import wait_healthy
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.server.app import build_app
from kvstrata.server.options import ServerOptions
from kvstrata.server.serve import make_server


@contextmanager
def running_server(model: str | None, model_name: str = "test-model", server_options: ServerOptions | None = None,
                   **engine_options):
    """Yields (base_url, app) while the server runs in a background thread, with `kvstrata serve`'s settings."""
    engine = LLMEngine(EngineConfig(model=model, **engine_options))
    options = server_options or ServerOptions()
    app = build_app(engine, model_name, options)
    port = free_port()
    server = make_server(app, "127.0.0.1", port, options, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    wait_healthy(base_url)
    try:
        yield base_url, app
    finally:
        server.should_exit = True
        thread.join(timeout=30)
