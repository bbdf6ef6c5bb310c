"""An ASGI middleware that bounds a request body before anything parses it: its size (413) and the time
the client takes to send it (408). Streaming responses read `receive` afterwards to notice a disconnect;
once the body is complete, `receive` passes through untouched."""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvstrata.server.responses import error_body


def too_large(max_bytes: int) -> str:
    return f"the request body exceeds the server's limit of {max_bytes} bytes (--max-request-bytes)"


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout: float):
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            # Answer at once, unread; the connection closes rather than draining what the client sends.
            response = JSONResponse(error_body(too_large(self.max_bytes), kind="request_too_large"), status_code=413,
                                    headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        received = 0
        body_done = False

        async def bounded_receive() -> Message:
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout)
            except TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {self.read_timeout:g} s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_bytes:
                    raise HTTPException(413, too_large(self.max_bytes))
            return message

        await self.app(scope, bounded_receive, send)
