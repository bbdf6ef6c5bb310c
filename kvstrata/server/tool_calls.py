"""Chat's tool calls, where the request names the function to call (`tool_choice: {"type": "function", ...}`) or
asks for one call or more (`"required"`): the output is held to the arguments' JSON schema, or to a list of
{"name", "parameters"} objects (vLLM's form), by structured output, then handed back as OpenAI's `tool_calls`.

`"auto"` (the model decides between text and calls) needs each model's own call format parsed from its text; the
engine has no such parser, so protocol.py refuses it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def named_call_schema(parameters: dict | None) -> dict:
    """The output of a call to one named function: its arguments."""
    return parameters if parameters is not None else NO_ARGUMENTS


def required_calls_schema(functions: dict[str, dict | None]) -> dict:
    """The output of `"required"`: one call or more, each {"name": one of `functions`, "parameters": its
    arguments}."""
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": named_call_schema(parameters)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, parameters in functions.items()]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass
class ToolCalls:
    """How one request's outputs become tool calls: `function` named, or any of the request's (`required`)."""

    function: str | None  # None: "required"

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a finished output, and its finish reason. A named call's arguments are the text
        as it came (cut short where the output was: OpenAI does the same); a "required" output that does not
        parse (cut short) stays text."""
        if self.function is not None:
            return {"role": "assistant", "content": None, "tool_calls": [tool_call(self.function, text)]}, finish_reason
        calls = self.required_calls(text)
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"

    @staticmethod
    def required_calls(text: str) -> list[dict] | None:
        try:
            calls = json.loads(text)
        except ValueError:
            return None
        return [tool_call(call["name"], json.dumps(call["parameters"])) for call in calls]

    def delta(self, new_text: str, first: bool, finished: bool, text: str, finish_reason: str | None) -> dict:
        """A streamed chunk's delta. A named call streams its arguments as they come (the first chunk also
        carrying the call's id and name); "required" calls are whole only at the end, so they come in the last
        chunk."""
        if self.function is not None:
            call = {"index": 0, "function": {"arguments": new_text}}
            if first:
                call = {**tool_call(self.function, new_text), "index": 0}
            return {"tool_calls": [call]} if new_text or first else {}
        if not finished:
            return {}
        message, _ = self.message(text, finish_reason)
        if message["content"] is not None:
            return {"content": message["content"]}
        return {"tool_calls": [{**call, "index": index} for index, call in enumerate(message["tool_calls"])]}

    def finish_reason(self, text: str, finish_reason: str | None) -> str | None:
        """A finished output's finish reason as `message` gives it; None while it runs."""
        return self.message(text, finish_reason)[1] if finish_reason is not None else None
