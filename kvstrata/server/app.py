"""The OpenAI-compatible HTTP API over an `AsyncEngine`."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.outputs import RequestOutput
from kvstrata.errors import KvstrataError
from kvstrata.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from kvstrata.server.metrics import ServerMetrics
from kvstrata.server.protocol import REQUEST_FIELDS, ChatCompletionRequest, CompletionRequest
from kvstrata.server.responses import ResponseBuilder, error_body, sse

log = logging.getLogger("kvstrata.server")
RETRY_AFTER_SECONDS = 1


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code=None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, param, kind, code), status_code=status, headers=headers)


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return _error(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    location = first.get("loc", ())[1:]  # drop the leading "body"
    if not location:
        return _error(400, f"request body must be a JSON object: {first['msg']}")
    # Union members add their type's name to the location; keep field names and list indexes.
    param = ".".join(str(p) for p in location if isinstance(p, int) or p in REQUEST_FIELDS)
    return _error(400, f"{param}: {first['msg']}", param)


def build_app(engine: LLMEngine, model_name: str, max_waiting: int = 256) -> FastAPI:
    metrics = ServerMetrics(model_name)
    async_engine = AsyncEngine(engine, max_waiting, metrics)
    tokenizer = engine.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.stop()

    app = FastAPI(title="kvstrata", lifespan=lifespan)
    app.state.async_engine = async_engine

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return _validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), kind="not_found_error" if exc.status_code == 404 else
                      "invalid_request_error")

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        return _error(500, f"internal error: {type(exc).__name__}", kind="internal_error")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()), "owned_by": "kvstrata",
            "max_model_len": engine.max_model_len,
        }]}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _serve(body, request, chat=True)

    async def _serve(body: CompletionRequest | ChatCompletionRequest, request: Request, chat: bool):
        if body.model != model_name:
            return _error(404, f"model {body.model!r} does not exist; this server has {model_name!r}", "model",
                          code="model_not_found")
        try:
            if chat:
                if tokenizer is None:
                    raise KvstrataError("this model has no tokenizer, so it cannot take chat messages")
                token_ids = tokenizer.encode_chat([m.plain() for m in body.messages])
                max_tokens, logprobs = body.max_completion_tokens or body.max_tokens, body.requested_logprobs
            else:
                token_ids = engine.tokenize(body.single_prompt)
                max_tokens, logprobs = body.max_tokens, body.logprobs
            engine.check_prompt_length(token_ids)
            params = body.sampling_params(max_tokens or engine.max_model_len - len(token_ids), logprobs)
            outputs = async_engine.generate(token_ids, params)
            first = await anext(outputs)  # errors before the first token are still plain HTTP errors
        except KvstrataError as exc:
            return _error(400, str(exc), "messages" if chat else "prompt")
        except QueueFullError as exc:
            return _error(503, f"server busy: {exc}; retry later", kind="server_overloaded",
                          headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        except EngineDeadError as exc:
            return _error(503, str(exc), kind="server_error", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        builder = ResponseBuilder(chat, model_name, tokenizer)
        if body.stream:
            return StreamingResponse(_stream(builder, first, outputs, body.include_usage),
                                     media_type="text/event-stream")
        final = await _last(first, outputs, request)
        if final is None:
            return Response(status_code=499)  # the client left; nothing to send
        return builder.full(final)

    return app


async def _last(first: RequestOutput, outputs: AsyncIterator[RequestOutput], request: Request) -> RequestOutput | None:
    """The final output, or None if the client disconnected first (the request is then aborted)."""
    final = first
    try:
        while not final.finished:
            if await request.is_disconnected():
                return None
            final = await anext(outputs)
    finally:
        await outputs.aclose()
    return final


async def _stream(builder: ResponseBuilder, first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                  include_usage: bool) -> AsyncIterator[str]:
    try:
        opening = builder.first_chunk()
        if opening is not None:
            yield sse(opening)
        output = first
        while True:
            chunk = builder.chunk(output)
            if chunk is not None:
                yield sse(chunk)
            if output.finished:
                break
            output = await anext(outputs)
        if include_usage:
            yield sse(builder.usage_chunk(output))
    except EngineDeadError as exc:
        yield sse(json.dumps(error_body(str(exc), kind="server_error")))
    finally:
        await outputs.aclose()  # a disconnect lands here: the request is aborted, its blocks freed
    yield sse("[DONE]")
