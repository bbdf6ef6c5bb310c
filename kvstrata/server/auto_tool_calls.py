"""`tool_choice: "auto"`: the model answers in text or calls the request's functions in its own format, which a
parser for that format reads from the text once the output has finished (the server takes it with vLLM's flags
`--enable-auto-tool-choice --tool-call-parser NAME`; tool_call_parsers.py names the formats). Nothing constrains
the output.

An output whose calls do not parse (JSON cut short, a function the request does not define, arguments that are not
an object) is handed back as the text it is: nothing the model wrote is lost or made up (`parallel_tool_calls:
false` alone keeps the first of several calls, as the client asked).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvstrata.server.tags import less_a_tag_begun
from kvstrata.server.tool_calls import openai_call_id, tool_call


@dataclass(frozen=True)
class Parsed:
    calls: list[dict]  # OpenAI's tool_calls
    before: str  # the text before the first call
    after: str  # text between and after the calls


@dataclass(frozen=True)
class AutoToolCalls:
    """How one request's outputs become text or tool calls, given the names of the functions it defines; a format's
    subclass finds the calls (`parse`) and says how much of a growing text is certainly no call (`shown`)."""

    functions: frozenset[str]
    parallel: bool = True  # False: the first call only (OpenAI's parallel_tool_calls)
    special_tags = ()  # tags of the format that a tokenizer may make special tokens, kept in the text for the parser
    new_call_id = staticmethod(openai_call_id)  # the ids the model's chat template takes back

    def parse(self, text: str, finish_reason: str | None) -> Parsed | None:
        """The output's calls (the first alone where not `parallel`) and the text around them; None where it has none
        or they do not all parse."""
        raise NotImplementedError

    def shown(self, text: str) -> str:
        """What may be streamed as content of a growing output: the part that can become neither a call nor the
        white space before one (which the content of a message of calls leaves out). What it gives of a text is
        the beginning of what it gives of any longer text that begins with it."""
        raise NotImplementedError

    def call(self, name, arguments, call_id: str | None = None) -> dict | None:
        """OpenAI's tool call of `name` with `arguments`, where the model's call names a function of the request and
        gives an object; None where it does not, or where the arguments have no JSON text a reply can carry (NaN,
        or a lone surrogate the model wrote as an escape)."""
        if not (isinstance(name, str) and name in self.functions and isinstance(arguments, dict)):
            return None
        try:
            text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
            text.encode()
        except (TypeError, ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
            return None
        return tool_call(name, text, call_id or self.new_call_id())

    def kept(self, calls: list[dict]) -> list[dict]:
        return calls if self.parallel else calls[:1]

    @staticmethod
    def content(parsed: Parsed) -> str | None:
        """The text beside the calls without the white space at its end (the lines around the calls); none where
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
        sent = self.shown(text[: len(text) - len(new_text)])
        if finish_reason is None:
            shown = self.shown(text)[len(sent) :]
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


class WholeOutputCalls(AutoToolCalls):
    """A format whose calls, where the model makes them, are its whole output: an output beginning with one of
    `openings` (after white space) may be calls and streams nothing until it ends; any other is text, streamed as
    it comes."""

    openings = ()

    def shown(self, text: str) -> str:
        begun = text.lstrip()
        may_be_calls = any(begun.startswith(opening) or opening.startswith(begun) for opening in self.openings)
        return "" if may_be_calls else text


class CallsAfterTag(AutoToolCalls):
    """A format whose calls begin at a tag (`open_tag`), after any text: that text streams until the tag may
    begin."""

    open_tag = ""

    def shown(self, text: str) -> str:
        """The text before the first call's tag, less any end of it that may yet become that tag."""
        start = text.find(self.open_tag)
        return (text[:start] if start >= 0 else less_a_tag_begun(text, self.open_tag)).rstrip()
