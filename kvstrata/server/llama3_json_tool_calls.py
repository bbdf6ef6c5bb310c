"""Tool calls as Llama 3.1, 3.2 and 3.3 write them for the request's functions (their chat templates ask for it):
the output is the calls alone, JSON objects `{"name": ..., "parameters": {...}}` ("arguments" is read too) apart by
`;`, after `<|python_tag|>` where the tokenizer's special tokens are kept in the text. An output that begins any
other way is text (a built-in tool's call, `<|python_tag|>brave_search.call(...)`, among it).
"""

from __future__ import annotations

import json
import re

from kvstrata.server.auto_tool_calls import Parsed, WholeOutputCalls

PYTHON_TAG = "<|python_tag|>"
_BETWEEN_CALLS = re.compile(r"[\s;]*")


class Llama3JsonToolCalls(WholeOutputCalls):
    openings = ("{", PYTHON_TAG)

    def parse(self, text: str, finish_reason: str | None) -> Parsed | None:
        calls_text = text.lstrip().removeprefix(PYTHON_TAG).lstrip()
        if not calls_text.startswith("{"):
            return None
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(calls_text):
            try:
                written, at = decoder.raw_decode(calls_text, at)
            except (ValueError, RecursionError):
                return None
            call = self.call(written.get("name"), written.get("arguments", written.get("parameters", {}))) \
                if isinstance(written, dict) else None
            if call is None:
                return None
            calls.append(call)
            at = _BETWEEN_CALLS.match(calls_text, at).end()
        return Parsed(self.kept(calls), "", "")
