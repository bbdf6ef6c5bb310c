"""A reasoning model's thinking apart from its answer (vLLM's `--reasoning-parser`): the text up to `</think>` comes
back as the message's `reasoning_content`, the rest as its `content` (and its tool calls, where the request has
them parsed).

- `qwen3`: Qwen3 thinks inside `<think>...</think>` at the start of its output; an output that does not begin with
  `<think>` (thinking switched off, e.g. `chat_template_kwargs: {"enable_thinking": false}`) is all answer.
- `deepseek_r1`: DeepSeek-R1 and the models whose chat template opens `<think>` in the prompt: the output is thinking
  until `</think>`, whether or not it writes `<think>` itself.

While an output streams, text that may still turn out to be a tag is held back, so a tag's letters never reach
either field.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.server.tags import less_a_tag_begun

OPEN, CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # --reasoning-parser's choices


@dataclass(frozen=True)
class Split:
    reasoning: str
    content: str


@dataclass(frozen=True)
class ReasoningParser:
    name: str  # one of REASONING_PARSERS

    def split(self, text: str, finished: bool) -> Split:
        """The reasoning and the answer of an output's text; while it is not `finished`, only what is certain."""
        start = text.lstrip()  # the tag may follow a line break
        body = start.removeprefix(OPEN)
        opened = len(body) < len(start)
        if not opened and not finished and OPEN.startswith(start):
            return Split("", "")  # a "<think>" may be under way
        if not opened and self.name == "qwen3":
            return Split("", text)
        if not opened:
            body = text  # deepseek_r1: the prompt opened the thought
        # The thought without the white space around it (the lines after <think> and before </think>): a growing
        # thought's trailing white space waits until text follows it.
        end = body.find(CLOSE)
        if end < 0:
            return Split((body if finished else less_a_tag_begun(body, CLOSE)).strip(), "")
        return Split(body[:end].strip(), body[end + len(CLOSE) :].lstrip("\n"))

    def message_fields(self, text: str) -> tuple[str | None, str]:
        """A finished output's reasoning (None where it has none) and its answer, as a stream of it sends them."""
        split = self.split(text, finished=True)
        return split.reasoning or None, split.content
