"""Run the server in-process on a free loopback port, for tests."""

from __future__ import annotations

import socket
import threading
from contextlib import contextmanager

import uvicorn

from kvstrata.bench.serve import wait_healthy
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.server.app import build_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(model: str | None, model_name: str = "test-model", max_waiting: int = 256, **options):
    """Yields (base_url, app) while a uvicorn server runs in a background thread."""
    engine = LLMEngine(EngineConfig(model=model, **options))
    app = build_app(engine, model_name, max_waiting)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    wait_healthy(base_url)
    try:
        yield base_url, app
    finally:
        server.should_exit = True
        thread.join(timeout=30)
