"""Tool calls as Hermes writes them (Qwen2.5, Qwen3, Hermes 2 and 3): text, then calls, each
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the format the chat templates of those models teach).
"""

from __future__ import annotations

import json
import re

from kvstrata.server.auto_tool_calls import CallsAfterTag, Parsed

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


class HermesToolCalls(CallsAfterTag):
    open_tag = OPEN
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
                written = json.loads(match.group(1))
            except (ValueError, RecursionError):
                return None
            call = self.call(written.get("name"), written.get("arguments", {})) if isinstance(written, dict) else None
            if call is None:
                return None
            calls.append(call)
        outside.append(text[end:])
        return Parsed(self.kept(calls), outside[0], "".join(outside[1:]))
