"""OpenAI request bodies, validated strictly: a wrong type or range is a 400 naming the field.

Every text field must be encodable as UTF-8: JSON can carry a lone surrogate (\\ud800), a tokenizer cannot."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from kvstrata.engine.beam_search import MAX_LENGTH_PENALTY, BeamSearchParams, refuse_sampling_settings
from kvstrata.engine.sampling_params import (
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_SEED,
    REPETITION_PENALTY_RANGE,
    SamplingParams,
)
from kvstrata.engine.structured_output import StructuredOutput
from kvstrata.errors import KvstrataError, ParameterError
from kvstrata.model.config import SAMPLING_DEFAULT_FIELDS
from kvstrata.model.tokenizer import TEMPLATE_ARGUMENTS
from kvstrata.server.tool_calls import ToolCalls

MAX_STOP_STRINGS = 16
MAX_CHOICES = 128  # OpenAI's bound on `n`
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")


def _encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text holds a lone surrogate {text[exc.start]!r} at character {exc.start}, which "
                         "UTF-8 cannot encode (send the character itself, or both halves of its surrogate "
                         "pair)") from None
    return text


def _check_stop(value):
    """One clear message for each way `stop` can be wrong (a union's errors would name the wrong member)."""
    if value == "":
        raise ValueError("stop strings must not be empty")
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):  # pydantic reports a ValueError, not a TypeError, as the field's error
        raise ValueError(f"stop must be a string or a list of strings, got {type(value).__name__}")  # noqa: TRY004
    if (bad := next((i for i, s in enumerate(value) if not isinstance(s, str)), None)) is not None:
        raise ValueError(f"stop must be a string or a list of strings; entry {bad} is {type(value[bad]).__name__}")
    if len(value) > MAX_STOP_STRINGS:
        raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(value)}")
    if "" in value:
        raise ValueError(f"stop strings must not be empty (entry {value.index('')} is)")
    return value


def _whole_number(value):
    """JSON does not tell 1 from 1.0 (JSON Schema's "integer" takes both); a fraction or a bool stays an error."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _only_off(off: str, is_off=lambda value: not value) -> AfterValidator:
    """A field of a feature the engine does not have: taken when off (false, empty or null, as `off` says), refused
    otherwise, never ignored."""

    def check(value):
        if not is_off(value):
            raise ValueError(f"is not supported: only {off}")
        return value

    return AfterValidator(check)


def integer(**constraints):
    """A JSON integer with `constraints` (ge=..., le=...), stated in the schema as minimum and maximum."""
    return Annotated[StrictInt, Field(**constraints), BeforeValidator(_whole_number)]


# vLLM's request priority: lower is served earlier, under --scheduling-policy priority (anything but 0 is refused
# otherwise); a 64-bit integer
Priority = integer(ge=-(2**63), le=2**63 - 1)


def _template_variables(value: dict) -> dict:
    taken = sorted(value.keys() & set(TEMPLATE_ARGUMENTS))
    if taken:
        raise ValueError(f"cannot set {', '.join(taken)}: the request's own fields give the template those")
    _encodable(json.dumps(value, ensure_ascii=False))  # the template may write any of its text
    return value


Text = Annotated[StrictStr, AfterValidator(_encodable)]
# vLLM's cache_salt: cached KV is shared only between requests giving the same string (SamplingParams.cache_salt)
CacheSalt = Annotated[Text, Field(min_length=1)]
# Further variables the chat template reads (vLLM's chat_template_kwargs; e.g. Qwen3's enable_thinking).
TemplateKwargs = Annotated[dict[str, object], AfterValidator(_template_variables)]
Number = Annotated[StrictFloat, AllowInfNan(False)]  # takes ints too, not bools; NaN and infinities are refused
JsonSchemaField = dict | Text  # a JSON schema, as an object or as its text
Choices = Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1)]
TokenIds = Annotated[list[integer(ge=0)], Field(min_length=1)]
NoList = Annotated[list | None, _only_off("empty or null"),
                   WithJsonSchema({"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]})]
OnlyNull = Annotated[object, _only_off("null", lambda value: value is None), WithJsonSchema({"type": "null"})]
OnlyFalse = Annotated[StrictBool, _only_off("false"), WithJsonSchema({"type": "boolean", "const": False})]


class JsonSchemaFormat(BaseModel):
    name: Text | None = None
    description: Text | None = None
    schema_: dict = Field(alias="schema")  # the JSON schema the answer follows
    strict: StrictBool | None = None  # (the answer always follows the schema)


class ResponseFormat(BaseModel):
    """OpenAI's: plain text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _schema_only_with_its_type(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("type") != "json_schema":
            raise ValueError("is taken only with type json_schema")
        return value

    def constraint(self) -> StructuredOutput | None:
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ParameterError("response_format.json_schema", "response_format.json_schema: type json_schema "
                                                                    "needs json_schema.schema")
            return StructuredOutput(json=self.json_schema.schema_)
        return StructuredOutput(json_object=True) if self.type == "json_object" else None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint; its other options are refused (not ignored)."""

    model_config = ConfigDict(extra="forbid")

    json_: JsonSchemaField | None = Field(None, alias="json")
    json_object: StrictBool | None = None
    regex: Text | None = None
    choice: Choices | None = None
    grammar: Text | None = None
    disable_any_whitespace: StrictBool = False  # JSON with no whitespace between its tokens

    def constraint(self) -> StructuredOutput:
        return StructuredOutput(json=self.json_, json_object=bool(self.json_object), regex=self.regex,
                                choice=self.choice, grammar=self.grammar,
                                any_whitespace=not self.disable_any_whitespace)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


# The values of the sampling settings a request and the model leave unset: SamplingParams' (OpenAI's and vLLM's)
UNSET_SAMPLING = {f.name: f.default for f in dataclasses.fields(SamplingParams) if f.name in SAMPLING_DEFAULT_FIELDS}


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints. Unknown fields are ignored, as vLLM does."""

    model_config = ConfigDict(extra="ignore")

    model: Text
    max_tokens: integer(ge=1) | None = None
    # These five, left unset, take the model's recommended values (--generation-config auto), else OpenAI's and
    # vLLM's defaults (temperature 1, top_p 1, top_k off, min_p 0, repetition_penalty 1).
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: integer(ge=-1) | None = None  # vLLM's -1 also means "off"
    seed: integer(ge=0, le=MAX_SEED) | None = None
    # _check_stop words the errors; the constraints inside state the same rules in the schema.
    stop: Annotated[Text | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)]
                    | None, BeforeValidator(_check_stop)] = None
    n: integer(ge=1, le=MAX_CHOICES) = 1  # samples of the prompt, each a choice; they share its KV blocks
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[Number, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] = 0
    frequency_penalty: Annotated[Number, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[integer(ge=0)] | None = None  # vLLM's: generation ends after any of these tokens
    # vLLM's sampling extras
    min_tokens: integer(ge=0) = 0  # at most the request's max_tokens (checked with it)
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[Number, Field(ge=REPETITION_PENALTY_RANGE[0],
                                                le=REPETITION_PENALTY_RANGE[1])] | None = None
    allowed_token_ids: Annotated[list[integer(ge=0)], Field(min_length=1)] | None = None  # only these generated
    truncate_prompt_tokens: integer(ge=1) | None = None  # only the prompt's last k tokens are used
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    priority: Priority = 0
    cache_salt: CacheSalt | None = None
    # vLLM's beam search: n beams wide, all n returned, best first (engine/beam_search.py); length_penalty and
    # early_stopping as transformers takes them
    use_beam_search: StrictBool = False
    length_penalty: Annotated[Number, Field(ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)] = 1
    early_stopping: StrictBool | Literal["never"] = False
    # vLLM's: words the output may not hold
    bad_words: Annotated[list[Annotated[Text, Field(pattern=r"\S")]], Field(max_length=MAX_BAD_WORDS)] | None = None
    # vLLM's: each prompt token's logprob and rank, with that many alternatives (not streamed)
    prompt_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None
    # structured output (at most one of these four ways): OpenAI's response_format, vLLM's structured_outputs, and
    # vLLM's older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchemaField | None = None
    guided_regex: Text | None = None
    guided_choice: Choices | None = None
    guided_grammar: Text | None = None
    guided_whitespace_pattern: OnlyNull = None
    structural_tag: OnlyNull = None
    # token ids as the object's keys (JSON keys are strings) -> bias added to the token's logit
    logit_bias: dict[Annotated[StrictStr, Field(pattern=r"^[0-9]+$")],
                     Annotated[Number, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None, defaults: dict | None = None) -> SamplingParams:
        """The request's sampling parameters; `defaults` stand for the settings it leaves unset (the model's)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        chosen = {name: value if (value := getattr(self, name)) is not None else (defaults or {}).get(name, unset)
                  for name, unset in UNSET_SAMPLING.items()}
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(chosen["temperature"]),
            top_p=float(chosen["top_p"]),
            top_k=max(int(chosen["top_k"]), 0),
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logit_bias={int(token): float(bias) for token, bias in (self.logit_bias or {}).items()},
            min_tokens=self.min_tokens,
            min_p=float(chosen["min_p"]),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(chosen["repetition_penalty"]),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=list(self.bad_words or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured_output=self.structured_output(),
            prompt_logprobs=self.prompt_logprobs,
            priority=self.priority,
            cache_salt=self.cache_salt,
        )

    def beam_search_params(self, sampling: SamplingParams) -> BeamSearchParams:
        """use_beam_search's parameters, ending where `sampling` (the request's prepared parameters) ends; a
        ParameterError names a setting that beam search would not follow, since it samples nothing and ranks
        continuations by the model's own likelihood."""
        refuse_sampling_settings(self, "use_beam_search")
        if self.constraint_field is not None:
            raise ParameterError(self.constraint_field, f"{self.constraint_field} cannot be combined with "
                                                        "use_beam_search: beam search does not constrain its output")
        if getattr(self, "max_tokens", None) == 0:
            raise ParameterError("max_tokens", "max_tokens 0 generates nothing to search; use_beam_search needs 1 "
                                               "or more")
        return BeamSearchParams(beam_width=self.n, max_tokens=sampling.max_tokens,
                                length_penalty=float(self.length_penalty), early_stopping=self.early_stopping,
                                ignore_eos=sampling.ignore_eos, stop_token_ids=tuple(sampling.stop_token_ids),
                                skip_special_tokens=sampling.skip_special_tokens, lora_name=sampling.lora_name,
                                priority=sampling.priority, cache_salt=sampling.cache_salt)

    def structured_output(self) -> StructuredOutput | None:
        """The constraint of whichever field gives one; ParameterError naming the field where it is wrong or a
        second field gives one too."""
        fields = self._constraint_fields()
        if len(fields) > 1:
            raise ParameterError(fields[1], f"{fields[1]} and {fields[0]} both constrain the output; give one")
        if not fields:
            return None
        field = fields[0]
        try:
            return self._constraint(field)
        except ParameterError:
            raise
        except KvstrataError as exc:
            raise ParameterError(field, f"{field}: {exc}") from None

    def _constraint(self, field: str) -> StructuredOutput:
        if field in ("response_format", "structured_outputs"):
            return getattr(self, field).constraint()
        return StructuredOutput(**{field.removeprefix("guided_"): getattr(self, field)})

    @property
    def constraint_field(self) -> str | None:
        """The field that constrains the output, if one does."""
        return next(iter(self._constraint_fields()), None)

    def _constraint_fields(self) -> list[str]:
        fields = [field for field in CONSTRAINT_FIELDS if getattr(self, field) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            fields.remove("response_format")
        return fields

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("stream"):
            raise ValueError("are not streamed (as in vLLM); ask for them without stream")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    # one prompt, or a batch of them (each a choice, or `n` choices: choice p * n + i is prompt p's sample i)
    prompt: (Annotated[Text, Field(min_length=1)] | TokenIds
             | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_CHOICES)])
    max_tokens: integer(ge=0) | None = 16  # 0 only with echo: the prompt scored, nothing generated shown
    logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None
    echo: StrictBool = False  # each choice's text (and logprobs) begins with its prompt's
    best_of: integer(ge=1, le=1, description="1 only") | None = None
    suffix: Annotated[Text | None, _only_off("empty or null"),
                      WithJsonSchema({"anyOf": [{"type": "string", "maxLength": 0}, {"type": "null"}]})] = None

    def sampling_params(self, max_tokens: int, logprobs: int | None, defaults: dict | None = None) -> SamplingParams:
        params = super().sampling_params(max_tokens, logprobs, defaults)
        if self.echo and logprobs is not None:  # the prompt's logprobs are echoed with it
            if self.prompt_logprobs not in (None, logprobs):
                raise ParameterError("prompt_logprobs", f"prompt_logprobs {self.prompt_logprobs} and echo with "
                                                        f"logprobs {logprobs} ask for the prompt's logprobs twice; "
                                                        "give one number")
            params = dataclasses.replace(params, prompt_logprobs=logprobs)
        return params

    @property
    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return self.prompt


def opens_assistant_turn(body: ChatCompletionRequest | TokenizeRequest) -> bool:
    """`add_generation_prompt` as the body gives it; left out, on unless the final message is to be continued."""
    if "add_generation_prompt" in body.model_fields_set:
        return body.add_generation_prompt
    return not body.continue_final_message


def text_part(part, types: tuple[str, ...]):
    """A message's content part, checked before its fields: a part of another type (an image, audio, a file) is
    refused by its type, where pydantic would ask for the text field it lacks."""
    if isinstance(part, dict) and isinstance(part.get("type"), str) and part["type"] not in types:
        allowed = " or ".join(repr(t) for t in types)
        raise ValueError(f"content parts of type {part['type']!r} are not supported: this model reads text only "
                         f"(parts of type {allowed})")
    return part


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, part):
        return text_part(part, ("text",))


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep to parse
        raise ValueError(f"must be a JSON object, as text; it does not parse: {exc}") from None
    if not isinstance(value, dict):  # a ValueError, which pydantic reports as the field's error
        raise ValueError(f"must be a JSON object, as text; it is a {type(value).__name__}")  # noqa: TRY004
    return value


class FunctionCall(BaseModel):
    name: Text
    arguments: Text  # a JSON object, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _arguments_are_an_object(cls, value):
        _json_object(value)
        return value


class ToolCall(BaseModel):
    id: Text
    type: Literal["function"]
    function: FunctionCall

    def plain(self) -> dict:
        """As chat templates read a call (transformers' form): the arguments as an object."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": _json_object(self.function.arguments)}}


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None  # only an assistant's message of tool calls may have none
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool's answer: to which call

    @model_validator(mode="after")
    def _fields_fit_the_role(self):
        if self.content is None and (self.role != "assistant" or not self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's message of tool calls may "
                             "have none)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only an assistant's message holds tool_calls, not a {self.role} message")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only a tool message, needs tool_call_id: the call it answers")
        return self

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content) if isinstance(self.content, list) else (self.content or "")

    def plain(self) -> dict:
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [call.plain() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(BaseModel):
    name: Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict | None = None  # the arguments' JSON schema (an object's); none: the function takes no arguments
    strict: StrictBool | None = None  # (the arguments always follow the schema)

    @field_validator("parameters")
    @classmethod
    def _parameters_describe_an_object(cls, value):
        if value is not None and value.get("type", "object") != "object":
            raise ValueError(f"must describe an object (the arguments), not type {value['type']!r}")
        return value


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


def plain_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as the chat template reads them."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


class FunctionName(BaseModel):
    name: Text


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    # The schema says what the validator below checks, so generated clients and fuzzers know it too.
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}}, "required": ["top_logprobs"]},
        "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
    })

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: integer(ge=1) | None = None
    logprobs: StrictBool = False
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None
    tools: list[Tool] | None = None  # rendered by the chat template; called where tool_choice asks (tool_calls.py)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(None, validate_default=True)
    parallel_tool_calls: StrictBool = True  # false: one call at most
    functions: NoList = None  # tools' deprecated form
    # vLLM's: the template opens the assistant's turn, or leaves the last message open for the model to continue
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: TemplateKwargs | None = None  # vLLM's too
    chat_template: Text | None = None  # vLLM's: in place of the model's, where the server trusts its clients' own
    include_reasoning: StrictBool = True  # vLLM's: with --reasoning-parser, the thinking is handed back (or dropped)
    # vLLM's chat extras the engine does not have: refused unless off
    echo: OnlyFalse = False
    documents: OnlyNull = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value, info: ValidationInfo):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs: true")
        return value

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("tools")
    @classmethod
    def _function_names_differ(cls, value):
        names = [tool.function.name for tool in value or []]
        if len(set(names)) < len(names):
            raise ValueError(f"define each function once; {names!r} repeats a name")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_fits_the_tools(cls, value, info: ValidationInfo):
        names = [tool.function.name for tool in info.data.get("tools") or []]
        if not names:
            if value not in (None, "none"):
                raise ValueError("needs tools")
        elif isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(f"names function {value.function.name!r}, which tools do not define (they define "
                             f"{', '.join(map(repr, names))})")
        return value

    @property
    def tool_calling(self) -> ToolCalls | None:
        """How the outputs become tool calls, where tool_choice asks for calls (checked against the tools)."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return None
        if self.tool_choice == "required":
            return ToolCalls(None, parallel=self.parallel_tool_calls)
        return ToolCalls(self.tool_choice.function.name)

    @property
    def model_chooses_tools(self) -> bool:
        """tool_choice "auto" (the default where tools are given): the model answers in text or calls them."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    @property
    def plain_tools(self) -> list[dict] | None:
        return plain_tools(self.tools)

    @property
    def constraint_field(self) -> str | None:
        """Tool calls' constraint is the tools' schemas."""
        field = super().constraint_field
        return "tools" if field == "tool_choice" else field

    def _constraint_fields(self) -> list[str]:
        fields = super()._constraint_fields()
        return ["tool_choice", *fields] if self.tool_calling is not None else fields

    def _constraint(self, field: str) -> StructuredOutput:
        if field != "tool_choice":
            return super()._constraint(field)
        # Either would hand back a call cut short, or not the one asked for, that reads as whole.
        if self.stop:
            raise ParameterError("stop", "stop strings cannot be combined with a tool_choice that asks for calls: "
                                         "they could cut the arguments short")
        if self.continue_final_message:
            raise ParameterError("continue_final_message", "continue_final_message cannot be combined with a "
                                                           "tool_choice that asks for calls: the call begins anew")
        functions = {tool.function.name: tool.function.parameters for tool in self.tools}
        return StructuredOutput(json=self.tool_calling.schema(functions))


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: the token ids the completions endpoint makes of `prompt`, or the chat endpoint of
    `messages` (exactly one of them)."""

    model: StrictStr
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool = True  # for a prompt: the model's BOS, as the completions endpoint adds
    add_generation_prompt: StrictBool = True  # for messages: the assistant's turn opened, as the chat endpoint does
    continue_final_message: StrictBool = False  # for messages: the last one left open, as the chat endpoint can
    tools: list[Tool] | None = None  # for messages: rendered by the chat template, as the chat endpoint does
    chat_template_kwargs: TemplateKwargs | None = None  # for messages: as the chat endpoint takes them
    chat_template: Text | None = None  # for messages: as the chat endpoint takes it

    @property
    def plain_tools(self) -> list[dict] | None:
        return plain_tools(self.tools)


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: the text of token ids, special tokens included (it tokenizes back to them)."""

    model: StrictStr
    tokens: TokenIds


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter: a PEFT adapter directory on the server's machine, served as model `lora_name`."""

    lora_name: StrictStr
    lora_path: StrictStr


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/unload_lora_adapter (its lora_int_id is taken and not needed: names identify adapters here)."""

    lora_name: StrictStr
    lora_int_id: StrictInt | None = None


REQUEST_FIELDS = frozenset(
    field.alias or name
    for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions, ResponseFormat,
                  JsonSchemaFormat, StructuredOutputs, ToolCall, FunctionCall, Tool, FunctionDefinition,
                  NamedToolChoice, FunctionName, TokenizeRequest, DetokenizeRequest)
    for name, field in model.model_fields.items()
)
