"""OpenAI's Responses API request (`POST /v1/responses`), taken as the chat request it amounts to: `instructions`
a system message first, `input` the messages (a text alone is the user's), earlier function calls and their outputs
the assistant's tool calls and the tool's answers, `max_output_tokens` the completion's limit, `text.format` the
response format, function `tools` the chat's. Everything the chat endpoint checks is checked as it checks it.

Nothing is stored: `previous_response_id`, `conversation` and `prompt` (stored state) are refused (send the whole
conversation as `input`), `background` and `top_logprobs` too.
`reasoning` (an effort, a summary) is accepted and not acted on, as vLLM does for models without effort levels;
earlier reasoning items in `input` are dropped, as chat templates drop earlier thinking.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, Tag, model_validator

from kvstrata.server.protocol import (
    CacheSalt,
    ChatCompletionRequest,
    JsonSchemaFormat,
    Number,
    OnlyFalse,
    OnlyNull,
    Priority,
    Text,
    integer,
    text_part,
)

# The chat request's fields that a Responses request names otherwise (for the errors of what the chat endpoint
# checks); a tool's and a named tool choice's fields lie in no "function" object here
CHAT_FIELDS_AS_NAMED_HERE = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                             "response_format": "text.format", "function": ""}


class ContentText(BaseModel):
    type: Literal["input_text", "output_text"]
    text: Text

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, part):
        return text_part(part, ("input_text", "output_text"))


def _joined(content: str | list[ContentText]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class InputMessage(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[ContentText]

    def chat(self) -> dict:
        return {"role": self.role, "content": _joined(self.content)}


class FunctionCallItem(BaseModel):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text


class FunctionCallOutputItem(BaseModel):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[ContentText]

    def chat(self) -> dict:
        return {"role": "tool", "tool_call_id": self.call_id, "content": _joined(self.output)}


class ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning"]


def _item_kind(item) -> str:
    """An input item's type; a message may leave it out (OpenAI's "easy" input message)."""
    return (item.get("type") if isinstance(item, dict) else getattr(item, "type", None)) or "message"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: Text
    description: Text | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: Text


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON that follows a schema (its name and schema beside the
    type, where chat nests them)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    description: Text | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("type json_schema needs a schema (the JSON schema the answer follows)")
        return self

    def response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        schema = JsonSchemaFormat(name=self.name, description=self.description, schema=self.schema_,
                                  strict=self.strict)
        return {"type": "json_schema", "json_schema": schema.model_dump(by_alias=True, exclude_none=True)}


class TextOptions(BaseModel):
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """Unknown fields are ignored, as the other endpoints do."""

    model_config = ConfigDict(extra="ignore")

    model: Text
    input: Text | Annotated[list[InputItem], Field(min_length=1)]
    instructions: Text | None = None
    max_output_tokens: integer(ge=1) | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool = True
    text: TextOptions | None = None
    reasoning: dict | None = None  # accepted, not acted on (the module's docstring)
    stream: StrictBool = False
    store: StrictBool = True  # nothing is kept either way
    metadata: dict[str, Text] | None = None  # handed back in the response
    user: Text | None = None
    include: list[Text] | None = None  # extra output the engine does not make (encrypted reasoning): none is added
    truncation: Literal["disabled"] | None = None
    top_logprobs: OnlyNull = None
    previous_response_id: OnlyNull = None
    conversation: OnlyNull = None  # a stored conversation's
    prompt: OnlyNull = None  # a stored prompt template's
    background: OnlyFalse = False
    priority: Priority = 0  # vLLM's (the chat endpoint's)
    cache_salt: CacheSalt | None = None  # vLLM's (the chat endpoint's)

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this one amounts to (pydantic's ValidationError where the chat endpoint refuses it)."""
        body = {"model": self.model, "messages": self._messages(), "stream": self.stream,
                "parallel_tool_calls": self.parallel_tool_calls, "priority": self.priority,
                "cache_salt": self.cache_salt}
        for name, value in (("max_completion_tokens", self.max_output_tokens), ("temperature", self.temperature),
                            ("top_p", self.top_p)):
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                             for tool in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) else {
                "type": "function", "function": {"name": self.tool_choice.name}}
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.response_format()
        return ChatCompletionRequest.model_validate(body)

    def _messages(self) -> list[dict]:
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, InputMessage):
                messages.append(item.chat())
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant":  # a turn's text and its calls: one message
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(item.chat())
        return messages


# The names a Responses request's fields have (errors name them)
RESPONSES_FIELDS = frozenset(
    field.alias or name
    for model in (ResponsesRequest, InputMessage, ContentText, FunctionCallItem, FunctionCallOutputItem,
                  FunctionTool, NamedFunction, TextFormat, TextOptions)
    for name, field in model.model_fields.items()
)
