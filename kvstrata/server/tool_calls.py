"""Chat's tool calls, where the request names the function to call (`tool_choice: {"type": "function", ...}`) or
asks for one call or more (`"required"`): the output is held to the arguments' JSON schema, or to a list of
{"name", "parameters"} objects (vLLM's form), by structured output, then handed back as OpenAI's `tool_calls`.

`"auto"` (the model decides between text and calls) needs each model's own call format parsed from its text: see
auto_tool_calls.py.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def arguments_schema(parameters: dict | None) -> dict:
    """A function's arguments: an object, as its `parameters` describe it (none: no arguments)."""
    return NO_ARGUMENTS if parameters is None else {"type": "object", **parameters}


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class ToolCalls:
    """How one request's outputs become tool calls: `function` named, or any of the request's (`required`)."""

    function: str | None  # None: "required"
    parallel: bool = True  # "required" may make several calls (OpenAI's parallel_tool_calls)
    new_call_id: Callable[[], str] = openai_call_id  # the calls' ids (Mistral's chat templates take 9 characters)

    def schema(self, functions: dict[str, dict | None]) -> dict:
        """What the output must be, given the request's functions (name: parameters): the named function's
        arguments, or one call or more (one where not `parallel`), each {"name": one of them, "parameters": its
        arguments}."""
        if self.function is not None:
            return arguments_schema(functions[self.function])
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": arguments_schema(parameters)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, parameters in functions.items()]
        return {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}), "items": {"anyOf": calls}}

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a finished output, and its finish reason. A named call's arguments are the text
        as it came (cut short where max_tokens cut the output: OpenAI does the same); a "required" output that does
        not parse (cut short) stays text."""
        if self.function is not None:
            call = tool_call(self.function, text, self.new_call_id())
            return {"role": "assistant", "content": None, "tool_calls": [call]}, finish_reason
        try:
            calls = [tool_call(call["name"], json.dumps(call["parameters"]), self.new_call_id())
                     for call in json.loads(text)]
        except (ValueError, RecursionError):
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"

    def chunk(self, new_text: str, opening: bool, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A streamed chunk's delta and finish reason (None until the output finished), given the text released so
        far (`new_text` its end). A named call streams its arguments as they come, its first chunk (`opening`) also
        carrying the call's id and name; "required" calls are whole only at the end, so they come in the last
        chunk."""
        if self.function is not None:
            call = {**tool_call(self.function, new_text, self.new_call_id()), "index": 0} if opening else {
                "index": 0, "function": {"arguments": new_text}}
            return ({"tool_calls": [call]} if new_text or opening else {}), finish_reason
        if finish_reason is None:
            return {}, None
        message, finish_reason = self.message(text, finish_reason)
        if message["content"] is not None:
            return {"content": message["content"]}, finish_reason
        return {"tool_calls": [{**call, "index": index} for index, call in enumerate(message["tool_calls"])]}, \
            finish_reason
