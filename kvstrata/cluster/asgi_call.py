"""Calling an ASGI app in-process and reading its response as it is produced.

A replica runs the single-server app unchanged and hands each forwarded HTTP request to it through
here, so validation, errors, streaming and metrics are the same code with one replica or many.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import ASGIApp


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: list[tuple[str, str]]


_END = object()


async def call_app(app: ASGIApp, method: str, path: str, query: str, headers: list[tuple[str, str]],
                   body: bytes) -> AsyncIterator[ResponseStart | bytes]:
    """Yields the response's start, then its body chunks as the app sends them. Leaving early (the
    caller went away) tells the app its client disconnected, and waits for the app to finish."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80),
    }
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            await messages.put(ResponseStart(message["status"], [
                (k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]))
        elif message["type"] == "http.response.body":
            if message.get("body"):
                await messages.put(bytes(message["body"]))
            if not message.get("more_body", False):
                await messages.put(_END)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(_END)  # a second end marker after a normal end is never read

    task = asyncio.create_task(run())
    try:
        while (message := await messages.get()) is not _END:
            yield message
        await task  # the app's own exception, if it raised one
    finally:
        disconnected.set()
        if not task.done():
            await asyncio.wait([task], timeout=5)
