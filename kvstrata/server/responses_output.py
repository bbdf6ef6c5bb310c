"""OpenAI's Responses API output, shaped from what the chat endpoint makes: a finished chat message becomes output
items (its thinking a `reasoning` item, its text a `message`, each tool call a `function_call`); a chat stream's
deltas become the Responses stream's events, each item opened, filled and closed in turn.
"""

from __future__ import annotations

import json
import time
import uuid

from pydantic import BaseModel

from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.model.tokenizer import Tokenizer
from kvstrata.server.responses_protocol import ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_event(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


class ResponseShaper:
    """One request's Response object, as its output grows."""

    def __init__(self, request: ResponsesRequest, model: str, tokenizer: Tokenizer | None,
                 params: SamplingParams | None = None):
        self.request = request
        self.model = model
        self.tokenizer = tokenizer
        self.params = params or SamplingParams()  # what it samples with: the values the response states
        self.id = _id("resp")
        self.created_at = int(time.time())

    def finished(self, output: list[dict], usage: dict, finish_reason: str) -> dict:
        """The Response of an output that ended: incomplete where max_output_tokens cut it."""
        return self.response("incomplete" if finish_reason == "length" else "completed", output, usage,
                             finish_reason)

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 finish_reason: str | None = None, error: dict | None = None) -> dict:
        r = self.request
        text_format = r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else {
            "type": "text"}
        tool_choice = r.tool_choice.model_dump() if isinstance(r.tool_choice, BaseModel) else r.tool_choice or "auto"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": r.parallel_tool_calls, "temperature": self.params.temperature,
            "top_p": self.params.top_p, "tool_choice": tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
            "text": {"format": text_format}, "reasoning": r.reasoning, "truncation": "disabled",
            "store": False, "metadata": r.metadata or {}, "user": r.user, "usage": usage,
        }

    def usage(self, chat_usage: dict, reasoning: str) -> dict:
        """The chat's token counts in the Responses API's names; the thinking's tokens counted by tokenizing it
        again."""
        thinking = len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning and self.tokenizer \
            else 0
        return {"input_tokens": chat_usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": chat_usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": thinking},
                "total_tokens": chat_usage["total_tokens"]}

    def full(self, chat_response: dict) -> dict:
        """The Response of a finished, non-streamed chat completion."""
        choice = chat_response["choices"][0]
        message = choice["message"]
        output = []
        if message.get("reasoning_content"):
            output.append(reasoning_item(_id("rs"), message["reasoning_content"], "completed"))
        if message.get("content"):
            output.append(message_item(_id("msg"), message["content"], "completed"))
        output += [function_call_item(_id("fc"), call, call["function"]["arguments"], "completed")
                   for call in message.get("tool_calls") or []]
        usage = self.usage(chat_response["usage"], message.get("reasoning_content") or "")
        return self.finished(output, usage, choice["finish_reason"])


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [output_text(text)] if status == "completed" else []}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [reasoning_text(text)] if status == "completed" else []}


def reasoning_text(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def function_call_item(item_id: str, call: dict, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": arguments, "status": status}


class ResponseEvents:
    """A Responses stream's events, from the chat stream's deltas of its one choice."""

    def __init__(self, shaper: ResponseShaper):
        self.shaper = shaper
        self.sequence = 0
        self.done: list[dict] = []  # the closed output items
        self.open: dict | None = None  # the item being filled: its kind, id, call and text so far
        self.reasoning = ""

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict]:
        response = self.shaper.response("in_progress", [])
        return [self._event("response.created", response=response), self._event("response.in_progress",
                                                                                 response=response)]

    def delta(self, chat_delta: dict) -> list[dict]:
        events = []
        if chat_delta.get("reasoning_content"):
            self.reasoning += chat_delta["reasoning_content"]
            events += self._text("reasoning", chat_delta["reasoning_content"])
        if chat_delta.get("content"):
            events += self._text("message", chat_delta["content"])
        for call in chat_delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def finish(self, finish_reason: str, chat_usage: dict) -> list[dict]:
        events = self._close()
        response = self.shaper.finished(self.done, self.shaper.usage(chat_usage, self.reasoning), finish_reason)
        return [*events, self._event(f"response.{response['status']}", response=response)]

    def fail(self, message: str, kind: str) -> list[dict]:
        error = {"code": kind, "message": message}
        return [self._event("response.failed", response=self.shaper.response("failed", self.done, error=error))]

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.done)}

    def _open(self, kind: str, item: dict, call: dict | None = None) -> list[dict]:
        events = self._close()
        self.open = {"kind": kind, "id": item["id"], "call": call, "text": ""}
        events.append(self._event("response.output_item.added", output_index=len(self.done), item=item))
        if kind != "function_call":
            part = output_text("") if kind == "message" else reasoning_text("")
            events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["kind"] != kind:
            maker = message_item if kind == "message" else reasoning_item
            events = self._open(kind, maker(_id("msg" if kind == "message" else "rs"), "", "in_progress"))
        self.open["text"] += text
        extra = {"logprobs": []} if kind == "message" else {}
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        return [*events, self._event(name, **self._where(), content_index=0, delta=text, **extra)]

    def _call(self, call: dict) -> list[dict]:
        """A call's first delta (with its id and name) opens it; later ones add to its arguments."""
        events = []
        if "id" in call:
            events = self._open("function_call", function_call_item(_id("fc"), call, "", "in_progress"), call)
        arguments = call["function"].get("arguments") or ""
        if arguments:
            self.open["text"] += arguments
            events.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def _close(self) -> list[dict]:
        """The open item's closing events; it joins the done items."""
        if self.open is None:
            return []
        kind, text, where = self.open["kind"], self.open["text"], self._where()
        if kind == "function_call":
            item = function_call_item(self.open["id"], self.open["call"], text, "completed")
            events = [self._event("response.function_call_arguments.done", **where, arguments=text)]
        else:
            item = (message_item if kind == "message" else reasoning_item)(self.open["id"], text, "completed")
            part = item["content"][0]
            done = "response.output_text.done" if kind == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if kind == "message" else {}
            events = [self._event(done, **where, content_index=0, text=text, **extra),
                      self._event("response.content_part.done", **where, content_index=0, part=part)]
        events.append(self._event("response.output_item.done", output_index=len(self.done), item=item))
        self.done.append(item)
        self.open = None
        return events
