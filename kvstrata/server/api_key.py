"""The server's API key (`--api-key`, or the KVSTRATA_API_KEY environment variable): every API request must carry
it as `Authorization: Bearer <key>`, as OpenAI's clients send it. /health, /metrics and the OpenAPI document stay
open, as vLLM leaves them, so probes and scrapers need no key."""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvstrata.server.responses import error_body

API_KEY_VARIABLE = "KVSTRATA_API_KEY"
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})


def refusal(key: str, path: str, authorization: bytes | None) -> JSONResponse | None:
    """The 401 for a request to `path` whose Authorization header does not carry `key`; None if it may pass."""
    if path in OPEN_PATHS or hmac.compare_digest(authorization or b"", f"Bearer {key}".encode()):  # constant time
        return None
    if not authorization:
        message = "the request has no API key; send the header Authorization: Bearer <key>"
    elif not authorization.startswith(b"Bearer "):
        message = "the Authorization header must read Bearer <key>, the word Bearer, a space and the key"
    else:
        message = "the API key in the Authorization header is not this server's"
    return JSONResponse(error_body(message, code="invalid_api_key"), status_code=401,
                        headers={"WWW-Authenticate": "Bearer"})


class ApiKeyCheck:
    """An ASGI middleware: a request without the key is answered 401 before its body is read."""

    def __init__(self, app: ASGIApp, key: str):
        self.app = app
        self.key = key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            response = refusal(self.key, scope["path"], dict(scope["headers"]).get(b"authorization"))
            if response is not None:
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
