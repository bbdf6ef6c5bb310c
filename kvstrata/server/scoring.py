"""vLLM's score API (`POST /score`, `/v1/score`) and its Jina- and Cohere-style rerank API (`POST /rerank`,
`/v1/rerank`, `/v2/rerank`), as vLLM serves them for embedding models: every text is embedded (embeddings.py) and a
pair's score is the cosine similarity of its two embeddings."""

from __future__ import annotations

import time
import uuid
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from kvstrata.engine.outputs import RequestOutput
from kvstrata.errors import ParameterError
from kvstrata.server.embeddings import MAX_INPUTS, EmbeddingRequest, prompt_tokens
from kvstrata.server.protocol import CacheSalt, Priority, Text, integer

Passage = Annotated[Text, Field(min_length=1)]
Passages = Annotated[list[Passage], Field(min_length=1, max_length=MAX_INPUTS)]


class ScoreRequest(BaseModel):
    """text_1 against each of text_2 (a text, or a list of one, broadcast), or pairwise (two lists of one length)."""

    model_config = ConfigDict(extra="ignore")

    model: Text
    text_1: Passage | Passages
    text_2: Passage | Passages
    truncate_prompt_tokens: integer(ge=1) | None = None  # only each text's last k tokens are used
    priority: Priority = 0
    cache_salt: CacheSalt | None = None

    def pairs(self) -> tuple[list[str], list[tuple[int, int]]]:
        """The texts to embed and the pairs scored, as indexes into them."""
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(first) != 1 and len(first) != len(second):
            raise ParameterError("text_1", f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, "
                                           f"or as many as text_2")
        texts = first + second
        return texts, [(0 if len(first) == 1 else i, len(first) + i) for i in range(len(second))]

    def embedding_request(self, texts: list[str]) -> EmbeddingRequest:
        return _embedding_request(self, texts)

    def field_names(self, texts: list[str]) -> list[str]:
        """What the request calls each text (errors name it)."""
        first = 1 if isinstance(self.text_1, str) else len(self.text_1)
        return [_name("text_1", self.text_1, i) for i in range(first)] + [
            _name("text_2", self.text_2, i) for i in range(len(texts) - first)]


class RerankRequest(BaseModel):
    """The documents ranked by their relevance to the query, best first; `top_n` of them (0: all)."""

    model_config = ConfigDict(extra="ignore")

    model: Text
    query: Passage
    documents: Passages
    top_n: integer() = 0  # 0 or less: all, as vLLM takes it
    truncate_prompt_tokens: integer(ge=1) | None = None
    priority: Priority = 0
    cache_salt: CacheSalt | None = None

    def embedding_request(self) -> EmbeddingRequest:
        return _embedding_request(self, [self.query, *self.documents])

    def field_names(self) -> list[str]:
        return ["query", *[f"documents.{i}" for i in range(len(self.documents))]]


SCORING_FIELDS = frozenset(ScoreRequest.model_fields) | frozenset(RerankRequest.model_fields)


def _embedding_request(body: ScoreRequest | RerankRequest, texts: list[str]) -> EmbeddingRequest:
    """The embeddings of `texts`, checked as the body's (a request may hold more texts than an embeddings request)."""
    return EmbeddingRequest.model_construct(model=body.model, input=texts, priority=body.priority,
                                            cache_salt=body.cache_salt,
                                            truncate_prompt_tokens=body.truncate_prompt_tokens)


def _name(field: str, value: str | list[str], index: int) -> str:
    return field if isinstance(value, str) else f"{field}.{index}"


def _cosine(outputs: list[RequestOutput], a: int, b: int) -> float:
    """The cosine of two normalized embeddings (their dot product, kept in [-1, 1] against float rounding)."""
    return min(1.0, max(-1.0, float(outputs[a].embedding @ outputs[b].embedding)))


def score_response(body: ScoreRequest, pairs: list[tuple[int, int]], outputs: list[RequestOutput]) -> dict:
    tokens = prompt_tokens(outputs)
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": body.model,
            "data": [{"index": i, "object": "score", "score": _cosine(outputs, a, b)} for i, (a, b) in enumerate(pairs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}


def rerank_response(body: RerankRequest, outputs: list[RequestOutput]) -> dict:
    scores = [_cosine(outputs, 0, 1 + i) for i in range(len(body.documents))]
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n if body.top_n > 0 else None]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": body.model,
            "usage": {"total_tokens": prompt_tokens(outputs)},
            "results": [{"index": i, "document": {"text": body.documents[i]}, "relevance_score": scores[i]}
                        for i in ranked]}
