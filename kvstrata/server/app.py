"""The OpenAI-compatible HTTP API over an `AsyncEngine`."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.outputs import RequestOutput
from kvstrata.errors import KvstrataError, ParameterError
from kvstrata.server.api_key import ApiKeyCheck
from kvstrata.server.async_engine import AsyncEngine, Choice, ServerError
from kvstrata.server.beam_search import beam_search_choices
from kvstrata.server.body_limit import BodyLimit
from kvstrata.server.embeddings import EMBEDDING_FIELDS, EmbeddingRequest, embedding_response, prepare_embeddings
from kvstrata.server.metrics import ServerMetrics
from kvstrata.server.openapi import (
    DETOKENIZE_RESPONSES,
    EMBEDDING_RESPONSES,
    LORA_UPDATE_RESPONSES,
    METRICS_RESPONSES,
    MODEL_RESPONSES,
    RERANK_RESPONSES,
    SCORE_RESPONSES,
    TOKENIZE_RESPONSES,
    ChatCompletionResponse,
    CompletionResponse,
    ResponsesResponse,
    completion_responses,
    fix_openapi,
)
from kvstrata.server.options import ServerOptions
from kvstrata.server.protocol import (
    REQUEST_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from kvstrata.server.request_prep import RequestPreparer
from kvstrata.server.responses import ResponseBuilder, error_body, sse
from kvstrata.server.responses_output import ResponseEvents, ResponseShaper, sse_event
from kvstrata.server.responses_protocol import CHAT_FIELDS_AS_NAMED_HERE, RESPONSES_FIELDS, ResponsesRequest
from kvstrata.server.scoring import SCORING_FIELDS, RerankRequest, ScoreRequest, rerank_response, score_response

log = logging.getLogger("kvstrata.server")
RETRY_AFTER_SECONDS = 1
# Pydantic types whose error only says "not this member of a union": another member's error says more.
_TYPE_MISMATCHES = {"string_type", "int_type", "float_type", "bool_type", "list_type", "dict_type", "model_type",
                    "model_attributes_type", "literal_error", "none_required"}


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code=None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, param, kind, code), status_code=status, headers=headers)


def _server_error(exc: ServerError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if exc.status == 503 else None
    return _error(exc.status, str(exc), kind=exc.kind, headers=headers)


def _not_started(exc: KvstrataError | ServerError, field: Callable[[str | None], str | None],
                 fallback: str) -> JSONResponse:
    """The answer to a request that could not start: its fault (a 400 naming `field` of the parameter at fault, or
    `fallback` where none is named; a 404 for an adapter unloaded since the model was checked) or the server's."""
    if isinstance(exc, ServerError):
        return _server_error(exc)
    if isinstance(exc, ParameterError) and exc.param == "lora_name":
        return _error(404, str(exc), "model", code="model_not_found")
    if isinstance(exc, ParameterError):
        return _error(400, str(exc), field(exc.param))
    return _error(400, str(exc), fallback)


def _validation_error(exc: RequestValidationError, content_type: str) -> JSONResponse:
    errors = exc.errors()
    first = errors[0]
    if first.get("type") == "json_invalid":
        return _error(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    # Of one field's errors (a union has one per member), the first that is not a mere type mismatch.
    same_field = [e for e in errors if e.get("loc", ())[:2] == first.get("loc", ())[:2]]
    chosen = next((e for e in same_field if e["type"] not in _TYPE_MISMATCHES), first)
    message = _error_message(chosen)
    location = chosen.get("loc", ())[1:]  # drop the leading "body"
    if not location:
        if chosen["type"] == "missing":
            return _error(400, "request body is empty: send a JSON object (Content-Type: application/json)")
        if not _read_as_json(content_type):
            got = f"got Content-Type {content_type!r}" if content_type else "the request had no Content-Type"
            return _error(400, f"request body must be a JSON object sent as Content-Type application/json, {got}")
        return _error(400, f"request body must be a JSON object: {message}")
    # Union members add their type's name to the location; keep field names and list indexes (and the name of a
    # field a body may not have, which is the error).
    fields = REQUEST_FIELDS | RESPONSES_FIELDS | EMBEDDING_FIELDS | SCORING_FIELDS
    named = [p for p in location if isinstance(p, int) or p in fields]
    if chosen["type"] == "extra_forbidden" and named[-1:] != [location[-1]]:
        named.append(location[-1])
    param = ".".join(str(p) for p in named)
    return _error(400, f"{param}: {message}", param)


def _read_as_json(content_type: str) -> bool:
    """Whether FastAPI parses a body of this Content-Type as JSON: application/json or a +json type; any other body,
    and one sent without a Content-Type (FastAPI's strict content types), reaches validation unparsed."""
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _error_message(error: dict) -> str:
    """A pydantic error's words (a validator's own message without pydantic's "Value error, ")."""
    return str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]


def _chat_request_error(exc: ValidationError) -> JSONResponse:
    """A Responses request whose chat request the chat endpoint refuses, named by the Responses API's fields."""
    error = exc.errors()[0]
    names = []
    for part in error["loc"]:  # the chat's names as the Responses API's ("messages" is "input", ...)
        names += [part] if isinstance(part, int) else CHAT_FIELDS_AS_NAMED_HERE.get(part, part).split(".")
    param = ".".join(str(name) for name in names if isinstance(name, int) or name in RESPONSES_FIELDS)
    return _error(400, f"{param}: {_error_message(error)}", param or None)


class CatchUnexpected:
    """Turns an unexpected error into one logged traceback and a JSON 500 (Starlette's own handler would
    log it a second time when it re-raises)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            log.exception("unexpected error serving %s %s", scope.get("method"), scope.get("path"))
            if scope["type"] == "http" and not started:
                await _error(500, f"internal error: {type(exc).__name__}", kind="internal_error")(scope, receive, send)


def build_app(engine: LLMEngine, model_name: str, options: ServerOptions | None = None) -> FastAPI:
    options = options or ServerOptions()
    adapters = {} if engine.lora is None else engine.lora.adapters  # LoRA adapters, each served as a model
    if model_name in adapters:
        raise KvstrataError(f"LoRA adapter name {model_name!r} is the served model's name; give it another")
    if options.allow_runtime_lora_updating and engine.lora is None:
        raise KvstrataError("--allow-runtime-lora-updating loads LoRA adapters: it needs --enable-lora")
    metrics = ServerMetrics(model_name, engine)
    async_engine = AsyncEngine(engine, options.max_waiting, metrics)
    preparer = RequestPreparer(engine, options)
    tokenizer = engine.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.stop()
        engine.close()  # after the engine thread ended: queued KV store writes finish

    # No /docs or /redoc: their pages load scripts from a CDN, which a server without internet cannot reach.
    app = FastAPI(title="kvstrata", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.async_engine = async_engine
    app.add_middleware(CatchUnexpected)
    app.add_middleware(BodyLimit, max_bytes=options.max_request_bytes, read_timeout=options.read_timeout)
    if options.api_key is not None:  # added last, so it runs first: no body is read for a request without the key
        app.add_middleware(ApiKeyCheck, key=options.api_key)
    fix_openapi(app, None if options.allow_runtime_lora_updating else [model_name, *adapters],
                engine.model_config.vocab_size, engine.max_model_len, options.max_tokens_limit)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return _validation_error(exc, request.headers.get("content-type", ""))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kinds = {404: "not_found_error", 405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large"}
        return _error(exc.status_code, str(exc.detail), kind=kinds.get(exc.status_code, "invalid_request_error"),
                      headers=exc.headers)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    def model_cards() -> list[dict]:
        created = int(time.time())
        base = {"id": model_name, "object": "model", "created": created, "owned_by": "kvstrata",
                "max_model_len": engine.max_model_len}
        # each LoRA adapter is a model of its own name, as vLLM lists them: its directory and the model it adapts
        return [base, *[{**base, "id": name, "root": str(adapter.path), "parent": model_name}
                        for name, adapter in dict(adapters).items()]]  # a copy: a load may change them meanwhile

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": model_cards()}

    @app.get("/v1/models/{model_id:path}", responses=MODEL_RESPONSES)
    async def model(model_id: str):
        """One served model's card (OpenAI's models.retrieve)."""
        card = next((card for card in model_cards() if card["id"] == model_id), None)
        return card if card is not None else _unknown_model(model_id)

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    for path, endpoint in (("/health", health), ("/v1/models", models), ("/metrics", prometheus_metrics)):
        app.add_api_route(path, endpoint, methods=["HEAD"], operation_id=f"{endpoint.__name__}_head")

    def _unknown_model(name: str) -> JSONResponse | None:
        if name == model_name or name in adapters:
            return None
        served = ", ".join(repr(served) for served in (model_name, *dict(adapters)))
        return _error(404, f"model {name!r} does not exist; this server has {served}", "model",
                      code="model_not_found")

    @app.post("/tokenize", responses=TOKENIZE_RESPONSES)
    async def tokenize(body: TokenizeRequest):
        if (unknown := _unknown_model(body.model)) is not None:
            return unknown
        try:
            token_ids = await asyncio.to_thread(preparer.tokenize, body)
        except ParameterError as exc:
            return _error(400, str(exc), exc.param)
        return {"count": len(token_ids), "max_model_len": engine.max_model_len, "tokens": token_ids}

    @app.post("/detokenize", responses=DETOKENIZE_RESPONSES)
    async def detokenize(body: DetokenizeRequest):
        if (unknown := _unknown_model(body.model)) is not None:
            return unknown
        try:
            return {"prompt": await asyncio.to_thread(preparer.detokenize, body)}
        except ParameterError as exc:
            return _error(400, str(exc), exc.param)

    if options.allow_runtime_lora_updating:
        @app.post("/v1/load_lora_adapter", responses=LORA_UPDATE_RESPONSES)
        async def load_lora_adapter(body: LoadLoRAAdapterRequest):
            name = body.lora_name
            if not name:
                return _error(400, "lora_name must not be empty", "lora_name")
            if name == model_name or name in adapters:
                return _error(400, f"the name {name!r} is taken: "
                                   f"{'the served model' if name == model_name else 'a loaded LoRA adapter'}",
                              "lora_name")
            try:
                await asyncio.to_thread(engine.load_lora, name, body.lora_path)  # reads and checks its files
            except KvstrataError as exc:
                return _error(400, str(exc), "lora_path")
            return PlainTextResponse(f"Success: LoRA adapter {name!r} added successfully.")

        @app.post("/v1/unload_lora_adapter", responses=LORA_UPDATE_RESPONSES)
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            name = body.lora_name
            if name not in adapters:
                return _error(404, f"no LoRA adapter {name!r} is loaded", "lora_name", code="model_not_found")
            engine.unload_lora(name)  # requests running on it finish on it
            return PlainTextResponse(f"Success: LoRA adapter {name!r} removed successfully.")

    @app.post("/v1/completions", responses=completion_responses(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(body, request)

    @app.post("/v1/chat/completions", responses=completion_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _serve(body, request)

    @app.post("/v1/responses", responses=completion_responses(ResponsesResponse))
    async def responses(body: ResponsesRequest, request: Request):
        try:
            chat = body.chat_request()
        except ValidationError as exc:
            return _chat_request_error(exc)
        started = await _start(chat, named=CHAT_FIELDS_AS_NAMED_HERE)
        if isinstance(started, Response):
            return started
        builder, first, outputs, requests = started
        shaper = ResponseShaper(body, body.model, tokenizer, requests[0][1])
        if body.stream:
            return StreamingResponse(_response_events(shaper, builder, first, outputs), media_type="text/event-stream")
        return await _whole(first, outputs, 1, request, lambda final: shaper.full(builder.full(final)))

    @app.post("/v1/embeddings", responses=EMBEDDING_RESPONSES)
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await _embedded(body, request, None, lambda final: embedding_response(body, final))

    async def score(body: ScoreRequest, request: Request):
        if (unknown := _unknown_model(body.model)) is not None:
            return unknown
        try:
            texts, pairs = body.pairs()
        except ParameterError as exc:
            return _error(400, str(exc), exc.param)
        return await _embedded(body.embedding_request(texts), request, body.field_names(texts),
                               lambda final: score_response(body, pairs, final))

    async def rerank(body: RerankRequest, request: Request):
        return await _embedded(body.embedding_request(), request, body.field_names(),
                               lambda final: rerank_response(body, final))

    for paths, endpoint, answers in ((("/score", "/v1/score"), score, SCORE_RESPONSES),
                                     (("/rerank", "/v1/rerank", "/v2/rerank"), rerank, RERANK_RESPONSES)):
        for path in paths:  # vLLM's paths, and Jina's and Cohere's for rerank
            app.add_api_route(path, endpoint, methods=["POST"], responses=answers,
                              operation_id=path.strip("/").replace("/", "_"))

    async def _embedded(body: EmbeddingRequest, request: Request, fields: list[str] | None,
                        shape: Callable[[list[RequestOutput]], dict]):
        """Embed the body's inputs (`fields`: what the client's request calls them) and shape the answer from their
        outputs, or the error response."""
        if (unknown := _unknown_model(body.model)) is not None:
            return unknown
        try:
            lora_name = None if body.model == model_name else body.model
            requests = await asyncio.to_thread(prepare_embeddings, preparer, body, lora_name, fields)
            outputs = async_engine.generate(requests)
            first = await anext(outputs)
        except (KvstrataError, ServerError) as exc:
            return _not_started(exc, lambda param: param, (fields or ["input"])[0].partition(".")[0])
        return await _whole(first, outputs, len(requests), request, shape)

    async def _start(body: CompletionRequest | ChatCompletionRequest, named: dict[str, str] | None = None,
                     request: Request | None = None):
        """Check and queue a request: its response builder, first output, the outputs after it and its choices'
        token ids and sampling parameters, or the error response. `named`: the names the client's endpoint gives
        the fields; `request`: the HTTP request, whose disconnect stops a beam search."""
        chat = isinstance(body, ChatCompletionRequest)
        if (unknown := _unknown_model(body.model)) is not None:
            return unknown
        named = named or {}
        try:
            preparer.precheck(body)
            # named by the model checked above: an adapter unloaded meanwhile fails the request (404), never
            # leaves it to the base model
            lora_name = None if body.model == model_name else body.model
            requests = await asyncio.to_thread(preparer.prepare, body, lora_name)
            if body.use_beam_search:
                outputs = beam_search_choices(async_engine, preparer.beam_searches(body, requests), tokenizer,
                                              request and request.is_disconnected)
            else:
                outputs = async_engine.generate(requests)
            first = await anext(outputs)  # errors before the first token are still plain HTTP errors
        except (KvstrataError, ServerError) as exc:
            return _not_started(exc, lambda param: named.get(param, param) or None,
                                named.get("messages", "messages") if chat else "prompt")
        echo_texts = None
        if not chat and body.echo:
            whole = body.truncate_prompt_tokens is None  # else the prompt's tokens kept are what is echoed
            echo_texts = [p if isinstance(p, str) and whole else None for p in body.prompts]
        builder = ResponseBuilder(chat, body.model, tokenizer, body.n, echo_texts,
                                  prompt_only=not chat and body.max_tokens == 0,
                                  tool_calls=preparer.tool_calls(body),
                                  reasoning=preparer.reasoning(body),
                                  include_reasoning=not chat or body.include_reasoning,
                                  prompt_logprobs=body.prompt_logprobs is not None)
        return builder, first, outputs, requests

    async def _serve(body: CompletionRequest | ChatCompletionRequest, request: Request):
        started = await _start(body, request=request)
        if isinstance(started, Response):
            return started
        builder, first, outputs, requests = started
        num_choices = len(requests)
        if body.stream:
            return StreamingResponse(_stream(builder, first, outputs, num_choices, body.include_usage),
                                     media_type="text/event-stream")
        return await _whole(first, outputs, num_choices, request, builder.full)

    return app


async def _whole(first: Choice, outputs: AsyncIterator[Choice], num_choices: int, request: Request,
                 shape: Callable[[list[RequestOutput]], dict]) -> dict | Response:
    """The non-streamed answer: every choice's final output, shaped; an error response where the engine failed."""
    try:
        final = await _last(first, outputs, num_choices, request)
    except ServerError as exc:
        return _server_error(exc)
    if final is None:
        return Response(status_code=499)  # the client left; nothing to send
    return shape(final)


async def _last(first: Choice, outputs: AsyncIterator[Choice], num_choices: int,
                request: Request) -> list[RequestOutput] | None:
    """Every choice's final output, or None if the client disconnected first (the choices are then aborted)."""
    latest = dict([first])
    finished = int(first[1].finished)
    try:
        while finished < num_choices:
            if await request.is_disconnected():
                return None
            index, output = await anext(outputs)
            latest[index] = output
            finished += output.finished
    finally:
        await outputs.aclose()
    return [latest[index] for index in range(num_choices)]


async def _stream(builder: ResponseBuilder, first: Choice, outputs: AsyncIterator[Choice], num_choices: int,
                  include_usage: bool) -> AsyncIterator[str]:
    try:
        for opening in builder.first_chunks(num_choices):
            yield sse(opening)
        latest, finished = {}, 0
        index, output = first
        while True:
            latest[index] = output
            finished += output.finished
            chunk = builder.chunk(index, output)
            if chunk is not None:
                yield sse(chunk)
            if finished == num_choices:
                break
            index, output = await anext(outputs)
        if include_usage:
            yield sse(builder.usage_chunk([latest[index] for index in range(num_choices)]))
    except ServerError as exc:
        yield sse(json.dumps(error_body(str(exc), kind=exc.kind)))
    finally:
        await outputs.aclose()  # a disconnect lands here: the request is aborted, its blocks freed
    yield sse("[DONE]")


async def _response_events(shaper: ResponseShaper, builder: ResponseBuilder, first: Choice,
                           outputs: AsyncIterator[Choice]) -> AsyncIterator[str]:
    """A Responses stream: the chat stream of its one choice, as the Responses API's events."""
    events = ResponseEvents(shaper)
    try:
        for event in events.start():
            yield sse_event(event)
        _, output = first
        while True:
            chunk = builder.chunk(0, output)
            if chunk is not None:
                for event in events.delta(chunk["choices"][0]["delta"]):
                    yield sse_event(event)
            if output.finished:
                finish_reason = chunk["choices"][0]["finish_reason"] if chunk else output.finish_reason
                for event in events.finish(finish_reason, builder.usage_chunk([output])["usage"]):
                    yield sse_event(event)
                break
            _, output = await anext(outputs)
    except ServerError as exc:
        for event in events.fail(str(exc), exc.kind):
            yield sse_event(event)
    finally:
        await outputs.aclose()  # a disconnect lands here: the request is aborted, its blocks freed
