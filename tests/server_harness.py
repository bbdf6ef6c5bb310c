"""Run the server in-process on a free loopback port, for tests."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.server.app import build_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise TimeoutError(f"no healthy server at {base_url} after {seconds} s")


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
