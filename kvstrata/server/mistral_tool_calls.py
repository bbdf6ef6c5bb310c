"""Tool calls as Mistral's models write them (vLLM's `mistral` parser): text, then the special token
`[TOOL_CALLS]` and either a JSON list of `{"name": ..., "arguments": {...}}` objects (Mistral 7B v0.3, Mixtral 8x22B,
Mistral Nemo) or, with tokenizers from v11 on (Mistral Small 3, Devstral), one `[TOOL_CALLS]name[ARGS]{...}` per
call (`[CALL_ID]id` after the name where the model writes one). Mistral's chat templates take a call back only with
an id of 9 letters and digits, so the calls get such ids (and so do the calls `tool_choice` forces, where the server
reads this format: request_prep.py).
"""

from __future__ import annotations

import json
import secrets
import string

from kvstrata.server.auto_tool_calls import CallsAfterTag, Parsed

OPEN, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ID_CHARACTERS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9))


class MistralToolCalls(CallsAfterTag):
    open_tag = OPEN
    special_tags = (OPEN, ARGS)  # the tokenizer's special tokens, kept in the text for the parser
    new_call_id = staticmethod(mistral_call_id)

    def parse(self, text: str, finish_reason: str | None) -> Parsed | None:
        start = text.find(OPEN)
        if start < 0:
            return None
        calls_text = text[start + len(OPEN) :]
        found = self._named_calls(calls_text.split(OPEN)) if ARGS in calls_text else self._listed_calls(calls_text)
        if found is None:
            return None
        calls = [self.call(name, arguments, call_id) for name, arguments, call_id in found]
        return None if None in calls else Parsed(self.kept(calls), text[:start], "")

    @staticmethod
    def _listed_calls(calls_text: str) -> list[tuple] | None:
        """[{"name": ..., "arguments": {...}}, ...] (one object alone is read too)."""
        try:
            listed = json.loads(calls_text)
        except (ValueError, RecursionError):
            return None
        listed = [listed] if isinstance(listed, dict) else listed
        if not (isinstance(listed, list) and listed and all(isinstance(call, dict) for call in listed)):
            return None
        return [(call.get("name"), call.get("arguments", {}), None) for call in listed]

    @staticmethod
    def _named_calls(pieces: list[str]) -> list[tuple] | None:
        """name[ARGS]{...} per piece, or name[CALL_ID]id[ARGS]{...}."""
        calls = []
        for piece in pieces:
            head, found, arguments = piece.partition(ARGS)
            if not found:
                return None
            name, _, call_id = head.partition(CALL_ID)
            try:
                calls.append((name.strip(), json.loads(arguments), call_id.strip() or None))
            except (ValueError, RecursionError):
                return None
        return calls
