"""Incremental detokenization: text grows token by token, never splitting a UTF-8 character."""

from __future__ import annotations

from kvstrata.model.tokenizer import Tokenizer

# Prompt tokens decoded with the output so that tokenizers which drop a leading space at the
# start of a decode (SentencePiece) still produce the right first word.
CONTEXT_TOKENS = 6
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes (may be empty while a character is partial)."""
        self.token_ids.append(token_id)
        prefix, full = self._decoded()
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """At the end of generation: whatever text is still held back for an incomplete character."""
        prefix, full = self._decoded()
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full[len(prefix) :]

    def _decoded(self) -> tuple[str, str]:
        """The text of the tokens before the unread ones, and with them."""
        skip = self.skip_special_tokens
        return (self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip),
                self.tokenizer.decode(self.token_ids[self.prefix_offset :], skip_special_tokens=skip))
