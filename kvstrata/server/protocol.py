"""OpenAI request bodies, validated strictly: a wrong type or range is a 400 naming the field."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

from kvstrata.engine.sampling_params import MAX_LOGPROBS, MAX_SEED, SamplingParams

Number = StrictFloat | StrictInt
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints. Unknown fields are ignored, as vLLM does."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[Number, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1)] = 0  # vLLM's -1 also means "off"
    seed: Annotated[StrictInt, Field(ge=0, le=MAX_SEED)] | None = None
    stop: StrictStr | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(max_length=16)] | None = None
    n: Literal[1] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Literal[0, 0.0] = 0
    frequency_penalty: Literal[0, 0.0] = 0
    ignore_eos: StrictBool = False

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=max(self.top_k, 0),
            seed=self.seed,
            stop=[s for s in stop if s],
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | TokenIds | Annotated[list[StrictStr], Field(min_length=1, max_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: Literal[False] = False

    @property
    def single_prompt(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: StrictStr | list[TextPart]

    def plain(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


REQUEST_FIELDS = frozenset().union(
    *(model.model_fields for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions))
)
