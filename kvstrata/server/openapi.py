"""The OpenAPI document says what the server answers: 400 (not FastAPI's default 422) for a bad body,
every error status an endpoint can give, event streams and Prometheus text as what they are."""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from kvstrata.server.embeddings import EmbeddingRequest, EmbeddingResponse
from kvstrata.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kvstrata.server.responses_protocol import ResponsesRequest
from kvstrata.server.scoring import RerankRequest, ScoreRequest

REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest, ResponsesRequest,
                  EmbeddingRequest, ScoreRequest, RerankRequest)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV was reused (prefix cache, KV store, saved context), not computed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict | None
    finish_reason: Literal["stop", "length", "abort"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict | None
    finish_reason: Literal["stop", "length", "abort"] | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ResponsesResponse(BaseModel):
    """OpenAI's Response object (responses_output.py shapes it; its output items as OpenAI describes them)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict]
    usage: dict | None


class ScoreData(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: dict


class RerankResult(BaseModel):
    index: int
    document: dict
    relevance_score: float


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: dict
    results: list[RerankResult]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


_ERRORS = {
    400: "The body is malformed or asks for something this server cannot do (the message names the field)",
    401: "The server asks for an API key (--api-key) and the Authorization header does not carry it",
    404: "No model of that name is served here",
    408: "The body did not arrive within the read timeout",
    413: "The body is larger than --max-request-bytes",
    500: "The request failed inside the engine (the message says why); other requests are unaffected",
    503: "The server is overloaded or shutting down; retry after the Retry-After seconds",
}
# With stream: true, each server-sent event's data is a JSON chunk (or an error object), the last one [DONE].
_STREAM = {"text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                            "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}


def completion_responses(model: type[BaseModel]) -> dict:
    errors = {status: {"model": ErrorResponse, "description": text} for status, text in _ERRORS.items()}
    return {200: {"model": model, "content": _STREAM}, **errors}


def _plain_responses(model: type[BaseModel]) -> dict:
    """An endpoint that does not reach the engine: its answer, or an error about the body or the model."""
    errors = {status: {"model": ErrorResponse, "description": _ERRORS[status]} for status in (400, 401, 404, 408, 413)}
    return {200: {"model": model}, **errors}


def _engine_responses(model: type[BaseModel]) -> dict:
    """An endpoint whose requests run in the engine, answered whole: its answer, or any error."""
    return {200: {"model": model},
            **{status: {"model": ErrorResponse, "description": text} for status, text in _ERRORS.items()}}


TOKENIZE_RESPONSES = _plain_responses(TokenizeResponse)
EMBEDDING_RESPONSES = _engine_responses(EmbeddingResponse)
SCORE_RESPONSES = _engine_responses(ScoreResponse)
RERANK_RESPONSES = _engine_responses(RerankResponse)
DETOKENIZE_RESPONSES = _plain_responses(DetokenizeResponse)
LORA_UPDATE_RESPONSES = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "What was done, in a sentence"},
    **{status: {"model": ErrorResponse, "description": text} for status, text in (
        (400, "The adapter cannot be loaded (the message says why), or its name is taken"),
        (401, _ERRORS[401]), (404, "No LoRA adapter of that name is loaded"), (408, _ERRORS[408]),
        (413, _ERRORS[413]))},
}
MODEL_RESPONSES = {
    200: {"description": "The model's card: id, object, created, owned_by, max_model_len (an adapter's also root, "
                         "its directory, and parent, the model it adapts)"},
    **{status: {"model": ErrorResponse, "description": _ERRORS[status]} for status in (401, 404)},
}
METRICS_RESPONSES = {200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                           "description": "Prometheus text exposition format"}}


def fix_openapi(app: FastAPI, model_names: list[str] | None, vocab_size: int, max_model_len: int,
                max_tokens_limit: int | None) -> None:
    """Replace FastAPI's generated document by the corrected one, which also states this server's own
    limits: the models it serves (one, and its LoRA adapters; None: they change while it runs), the token ids its
    vocabulary has, the largest max_tokens it takes."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema["paths"].values():
                for method, operation in path.items():
                    operation["responses"].pop("422", None)  # validation errors are answered 400
                    if method == "head":
                        operation["responses"] = {"200": {"description": "The GET response's headers, no body"}}
            components = schema["components"]["schemas"]
            for unused in ("HTTPValidationError", "ValidationError"):
                components.pop(unused, None)
            # FastAPI re-reads pydantic's schemas into float-typed fields (the seed's maximum 2**63 - 1 came
            # out as 9.223372036854776e+18); pydantic's own output is exact.
            for model in REQUEST_MODELS:
                generated = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(generated.pop("$defs", {}))
                fields = generated["properties"]
                if model_names is not None:
                    fields["model"]["enum"] = model_names
                for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                    if name in fields and max_tokens_limit is not None:
                        fields[name]["anyOf"][0]["maximum"] = max_tokens_limit
                # a prompt or embedding input of token ids, alone or in a batch (the Responses API's prompt is null)
                for name in ("prompt", "input"):
                    for form in fields.get(name, {}).get("anyOf", []):
                        token_ids = form["items"] if form.get("items", {}).get("type") == "array" else form
                        if token_ids.get("items", {}).get("type") == "integer":
                            token_ids["items"]["maximum"] = vocab_size - 1
                            # a prompt keeps a token for its output; an input to embed may fill the context
                            token_ids["maxItems"] = max_model_len - (name == "prompt")
                if "tokens" in fields:
                    fields["tokens"]["items"]["maximum"] = vocab_size - 1
                components[model.__name__] = generated
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
