"""OpenAI's embeddings endpoint (`POST /v1/embeddings`): each input's embedding from the engine, computed as a
prompt that generates nothing (engine/pooling_params.py), batched with whatever else runs."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from kvstrata.engine.outputs import RequestOutput
from kvstrata.engine.pooling_params import PoolingParams
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.errors import KvstrataError, ParameterError
from kvstrata.server.protocol import CacheSalt, Priority, Text, TokenIds, integer

if TYPE_CHECKING:  # the cluster's front reads requests without an engine
    from kvstrata.server.request_prep import RequestPreparer

MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one request


class EmbeddingRequest(BaseModel):
    """OpenAI's fields, and vLLM's truncate_prompt_tokens, normalize, priority and cache_salt. Unknown fields are
    ignored, as the other endpoints do."""

    model_config = ConfigDict(extra="ignore")

    model: Text
    # one text or token-id list, or a batch of them: each gets its own embedding, in order
    input: (Annotated[Text, Field(min_length=1)] | TokenIds
            | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1, max_length=MAX_INPUTS)]
            | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"  # base64: the float32 values' little-endian bytes
    dimensions: integer(ge=1) | None = None  # only the first n values (Matryoshka models), then normalized
    user: Text | None = None
    truncate_prompt_tokens: integer(ge=1) | None = None  # only each input's last k tokens are used
    normalize: StrictBool = True  # to unit length
    priority: Priority = 0
    cache_salt: CacheSalt | None = None

    @property
    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str) or isinstance(self.input[0], int):
            return [self.input]
        return self.input


class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


EMBEDDING_FIELDS = frozenset(EmbeddingRequest.model_fields)  # the names its errors may give


def prepare_embeddings(preparer: RequestPreparer, body: EmbeddingRequest, lora_name: str | None,
                       fields: list[str] | None = None) -> list[tuple[list[int], SamplingParams]]:
    """In a worker thread: each input's token ids and parameters, on LoRA adapter `lora_name` (None: the base
    model); ParameterError naming what is wrong. `fields`: what the client's request calls each input (the score
    and rerank requests' texts); by default `input`, or `input.i` in a batch."""
    engine, limit = preparer.engine, preparer.options.max_waiting
    inputs = body.inputs
    if fields is None:
        fields = ["input"] if len(inputs) == 1 else [f"input.{i}" for i in range(len(inputs))]
    if len(inputs) > limit:  # they could never be admitted together
        raise ParameterError(fields[-1].partition(".")[0], f"{len(inputs)} texts exceed this server's "
                                                           f"--max-waiting of {limit}")
    params = SamplingParams(max_tokens=1, pooling=PoolingParams(body.normalize, body.dimensions),
                            lora_name=lora_name, priority=body.priority, cache_salt=body.cache_salt)
    engine.check_sampling(params)
    requests = []
    for field, text in zip(fields, inputs):
        if isinstance(text, str) and body.truncate_prompt_tokens is None:
            preparer.check_text_length(field, field, len(text))
        try:
            token_ids = engine.tokenize(text)
            if body.truncate_prompt_tokens is not None:
                token_ids = token_ids[-body.truncate_prompt_tokens :]
            engine.check_prompt_length(token_ids, generates=False)
        except KvstrataError as exc:
            raise ParameterError(field, f"{field}: {exc}") from exc
        requests.append((token_ids, params))
    return requests


def embedding_response(body: EmbeddingRequest, outputs: list[RequestOutput]) -> dict:
    data = [{"object": "embedding", "index": index, "embedding": _encoded(output, body.encoding_format)}
            for index, output in enumerate(outputs)]
    tokens = prompt_tokens(outputs)
    return {"object": "list", "data": data, "model": body.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def prompt_tokens(outputs: list[RequestOutput]) -> int:
    """The usage of embedding requests: their prompts' tokens."""
    return sum(len(output.prompt_token_ids) for output in outputs)


def _encoded(output: RequestOutput, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(output.embedding.numpy().astype("<f4").tobytes()).decode()
    return output.embedding.tolist()
