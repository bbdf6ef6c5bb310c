"""One engine replica: the single-server app, run in-process, answering the requests the front forwards."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import replace

from kvstrata.cluster.asgi_call import ResponseStart, call_app
from kvstrata.config import EngineConfig
from kvstrata.engine.torch_threads import default_threads
from kvstrata.kv.kv_events import KVEventLog, KVEvents
from kvstrata.kv.store.spec import disk_part
from kvstrata.server.options import ServerOptions


def per_replica_store(spec: str | None, index: int) -> str | None:
    """The replica's `--kv-store`: the same host and Redis tiers, but a disk tier in a directory of its
    own (a disk tier's index lives in one process; two writing one directory would evict each other's
    files unseen). Redis is the tier replicas share."""
    if spec is None:
        return None
    parts = []
    for part in spec.split(","):
        part = part.strip()
        if part.startswith("disk:"):
            directory, size = disk_part(part)
            part = f"disk:{os.path.join(directory, f'replica-{index}')}:{size}"
        parts.append(part)
    return ",".join(parts)


def replica_config(config: EngineConfig, index: int, num_replicas: int) -> EngineConfig:
    """Replicas on one machine split its cores unless --threads says otherwise."""
    threads = config.threads or max(1, default_threads() // num_replicas)
    return replace(config, threads=threads, kv_store=per_replica_store(config.kv_store, index))


class EngineReplica:
    """A Ray Serve deployment of one engine and its OpenAI-compatible app."""

    def __init__(self, config: EngineConfig, model_name: str, options: ServerOptions, kv_events: bool = False):
        from kvstrata.engine.llm_engine import LLMEngine
        from kvstrata.server.app import build_app

        self.engine = LLMEngine(config)
        self.events = None  # what the prefix cache holds, for a kv-aware front
        if kv_events:
            self.events = self.engine.kv_manager.pool.events = KVEventLog()
        self.app = build_app(self.engine, model_name, options)
        self.app.state.async_engine.start()  # what the app's lifespan does under uvicorn

    async def forward(self, method: str, path: str, query: str, headers: list[tuple[str, str]],
                      body: bytes) -> AsyncIterator[ResponseStart | bytes]:
        async for message in call_app(self.app, method, path, query, headers, body):
            yield message

    def kv_events(self, log_id: str | None, cursor: int) -> tuple[bytes, int | None, KVEvents]:
        """The changes to the prefix cache after `cursor` (or a snapshot: kv_events.py), with the namespace its
        block hashes are chained from and the sliding window it matches prefixes under (None: none)."""
        if self.events is None:
            raise RuntimeError("this replica was started without KV events (the front's routing is not kv-aware)")
        return self.engine.kv_manager.namespace, self.engine.kv_manager.window, self.events.since(log_id, cursor)

    def identity(self) -> dict:
        """What the front checks before sending a replica requests (the fingerprint of the model it serves),
        and its process (for operators and tests)."""
        return {"fingerprint": self.engine.model_fingerprint, "pid": os.getpid()}

    def __del__(self):  # Ray Serve's shutdown hook: requests in flight end with an error; store writes finish
        self.app.state.async_engine.stop()
        self.engine.close()
