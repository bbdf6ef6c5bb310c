"""`tool_choice: "auto"` for models that write their calls as Hermes does (Qwen2.5, Qwen3, Hermes 2 and 3): the
model answers in text, or writes calls after it, each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(the format the chat templates of those models teach it). The server takes it with vLLM's flags
`--enable-auto-tool-choice --tool-call-parser hermes`; nothing constrains the output, and its text is parsed once
it has finished.

An output whose calls do not parse (JSON cut short, a function the request does not define, arguments that are not
an object) is handed back as the text it is: nothing the model wrote is lost or made up (`parallel_tool_calls:
false` alone keeps the first of several calls, as the client asked).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kvstrata.server.tags import less_a_tag_begun
from kvstrata.server.tool_calls import tool_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)  # --tool-call-parser's choices
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


def _text_before_any_call(text: str) -> str:
    """What may be shown of a growing output as content: the text before its first call's tag, less any end of it
    that may yet become that tag and the white space before it (which the content of a message of calls leaves
    out)."""
    start = text.find(OPEN)
    return (text[:start] if start >= 0 else less_a_tag_begun(text, OPEN)).rstrip()


@dataclass(frozen=True)
class Parsed:
    calls: list[dict]  # OpenAI's tool_calls
    before: str  # the text before the first call
    after: str  # text between and after the calls


@dataclass(frozen=True)
class HermesToolCalls:
    """How one request's outputs become text or tool calls, given the names of the functions it defines."""

    functions: frozenset[str]
    parallel: bool = True  # False: the first call only (OpenAI's parallel_tool_calls)

    def parse(self, text: str, finish_reason: str | None) -> Parsed | None:
        """The output's calls (the first alone where not `parallel`) and the text around them; None where it has none
        or they do not all parse. A last call left open counts only where the model ended its output there (finish
        reason "stop")."""
        if OPEN not in text:
            return None
        calls, outside, end = [], [], 0
        for match in _CALL.finditer(text):
            outside.append(text[end : match.start()])
            end = match.end()
            if not match.group(0).endswith(CLOSE) and finish_reason != "stop":
                return None
            try:
                call = json.loads(match.group(1))
            except (ValueError, RecursionError):
                return None
            if not (isinstance(call, dict) and call.get("name") in self.functions
                    and isinstance(call.get("arguments", {}), dict)):
                return None
            calls.append(tool_call(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)))
        outside.append(text[end:])
        return Parsed(calls if self.parallel else calls[:1], outside[0], "".join(outside[1:]))

    @staticmethod
    def content(parsed: Parsed) -> str | None:
        """The text beside the calls without the white space at its end (the lines around the tags); none where
        there is nothing else."""
        text = (parsed.before + parsed.after).rstrip()
        return text if text.strip() else None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a finished output, and its finish reason ("tool_calls" where it made calls);
        text beside the calls is its content."""
        parsed = self.parse(text, finish_reason)
        if parsed is None:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": self.content(parsed), "tool_calls": parsed.calls}, "tool_calls"

    def chunk(self, new_text: str, opening: bool, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A streamed chunk's delta and finish reason, given the text released so far (`new_text` its end): text
        streams as content until a call may begin; the calls come whole in the last chunk (with any text after
        them), or, where they do not parse, the text held back."""
        sent = _text_before_any_call(text[: len(text) - len(new_text)])
        if finish_reason is None:
            shown = _text_before_any_call(text)[len(sent) :]
            return ({"content": shown} if shown else {}), None
        parsed = self.parse(text, finish_reason)
        if parsed is None:
            rest = text[len(sent) :]
            return ({"content": rest} if rest else {}), finish_reason
        delta: dict = {"tool_calls": [{**call, "index": index} for index, call in enumerate(parsed.calls)]}
        rest = (self.content(parsed) or "")[len(sent) :]  # the message's content begins with the text sent
        if rest:
            delta = {"content": rest, **delta}
        return delta, "tool_calls"
