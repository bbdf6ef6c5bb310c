"""Tool calls as Hermes writes them (Qwen2.5, Qwen3, Hermes 2 and 3): text, then calls, each
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the format the chat templates of those models teach).
"""

from __future__ import annotations

import json
import re

from kvstrata.server.auto_tool_calls import AutoToolCalls, Parsed
from kvstrata.server.tags import less_a_tag_begun
from kvstrata.server.tool_calls import tool_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


class HermesToolCalls(AutoToolCalls):
    special_tags = (OPEN,)  # Hermes 2 Pro's tokenizer makes it one; Qwen's do not

    def parse(self, text: str, finish_reason: str | None) -> Parsed | None:
        """A last call left open counts only where the model ended its output there (finish reason "stop")."""
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
        return Parsed(self.kept(calls), outside[0], "".join(outside[1:]))

    def shown(self, text: str) -> str:
        """The text before the first call's tag, less any end of it that may yet become that tag."""
        start = text.find(OPEN)
        return (text[:start] if start >= 0 else less_a_tag_begun(text, OPEN)).rstrip()
