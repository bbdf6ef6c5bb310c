"""Structured output's run-time half: a request's constraint (structured_output.py) compiled by llguidance into a
matcher that follows its sequence's output and, before each token, tells which tokens may come next.

llguidance needs every token as the bytes it adds to the text. It reads them from most tokenizers' own
description (byte-level BPE such as the default model's); for one it cannot read (SentencePiece's Metaspace
decoder, for instance), each token is decoded after a fixed token, so that it reads as it does inside a text,
which is how the detokenizer renders an output.

A matcher costs a compilation (a large JSON schema: milliseconds to a second), so compiled constraints are kept
(the last COMPILED_KEPT) and each sequence gets a copy: the `n` choices of one request, and later requests with the
same schema, compile once.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from kvstrata.engine.structured_output import StructuredOutput
from kvstrata.errors import KvstrataError, ParameterError
from kvstrata.model.tokenizer import Tokenizer

COMPILED_KEPT = 64
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces
_ENCODER_REFUSAL = re.compile(r"ValueError\('(no token of this tokenizer holds byte 0x[0-9a-f]+)'\)")


class _TokensInContext:
    """What llguidance's TokenizerWrapper reads of a tokenizer it cannot read itself: every token's bytes as they
    read inside a text, the special tokens, and an encoder into tokens of those bytes."""

    def __init__(self, tokenizer: Tokenizer, eos_token_id: int):
        backend = tokenizer.backend
        anchor = tokenizer.encode("a", add_special_tokens=False)[-1]  # any plain token will do
        lead = backend.decode([anchor], skip_special_tokens=False)
        specials = {token.content for token in backend.get_added_tokens_decoder().values() if token.special}
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for token in range(backend.get_vocab_size(with_added_tokens=True)):
            piece = backend.id_to_token(token)
            if piece in specials:
                self.special_token_ids.append(token)
                self.tokens.append(piece.encode())
                continue
            self.tokens.append(self._bytes(backend, anchor, lead, token, piece))
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        special = set(self.special_token_ids)
        self._ids = {piece: token for token, piece in enumerate(self.tokens) if piece and token not in special}
        self._longest = max(map(len, self._ids))

    @staticmethod
    def _bytes(backend, anchor: int, lead: str, token: int, piece: str | None) -> bytes:
        text = backend.decode([anchor, token], skip_special_tokens=False)
        if "\ufffd" in text:  # part of a character: only a byte-fallback piece says which byte
            byte = _BYTE_TOKEN.fullmatch(piece or "")
            if byte is None:
                raise KvstrataError(f"structured output cannot read this tokenizer: token {token} ({piece!r}) "
                                    "decodes to part of a character")
            return bytes([int(byte.group(1), 16)])
        if not text.startswith(lead):
            raise KvstrataError(f"structured output cannot read this tokenizer: token {token} ({piece!r}) changes "
                                "the text before it when decoded")
        return text[len(lead):].encode()

    def __call__(self, text: str | bytes) -> list[int]:
        """Tokens whose bytes make `text`, longest first. The tokenizer's own encoder will not do: a Metaspace one
        puts a space before the text."""
        data = text.encode() if isinstance(text, str) else text
        tokens, start = [], 0
        while start < len(data):
            end = min(len(data), start + self._longest)
            while end > start and data[start:end] not in self._ids:
                end -= 1
            if end == start:
                raise ValueError(f"no token of this tokenizer holds byte {data[start]:#x}")
            tokens.append(self._ids[data[start:end]])
            start = end
        return tokens


def llguidance_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: set[int]) -> LLTokenizer:
    """The tokenizer as llguidance sees it, over the model's `vocab_size` logits (tokens past the tokenizer's are
    never allowed); any of `eos_token_ids` may end a complete output."""
    eos = sorted(eos_token_ids)
    if not eos:
        raise KvstrataError("structured output needs the model's end-of-sequence token; this model names none")
    try:
        return LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    except ValueError:  # a decoder llguidance does not read
        wrapper = TokenizerWrapper(_TokensInContext(tokenizer, eos[0]))
        return LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)


class GrammarCompiler:
    """One per engine: compiles requests' constraints into matchers (thread-safe: a server checks requests in
    worker threads while the engine thread adds them)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: set[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._lltokenizer: LLTokenizer | None = None  # built on first use (a quarter second for the default model)
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, constraint: StructuredOutput) -> LLMatcher:
        """A fresh matcher for one sequence's output. Raises ParameterError("structured_output") naming what is
        wrong with the constraint."""
        return self._compile(constraint).deep_copy()

    def check(self, constraint: StructuredOutput) -> None:
        """Compile `constraint` (kept for the request's matchers); raises as `matcher` does."""
        self._compile(constraint)

    def _compile(self, constraint: StructuredOutput) -> LLMatcher:
        if self._tokenizer is None:
            raise ParameterError("structured_output", "structured output needs the model's tokenizer; this model "
                                                      "has none")
        try:
            grammar = constraint.llguidance_grammar()
        except KvstrataError as exc:
            raise ParameterError("structured_output", str(exc)) from None
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar]
            if self._lltokenizer is None:
                try:
                    self._lltokenizer = llguidance_tokenizer(self._tokenizer, self._vocab_size, self._eos_token_ids)
                except KvstrataError as exc:
                    raise ParameterError("structured_output", str(exc)) from None
            compiled = LLMatcher(self._lltokenizer, grammar, log_level=0)
            if compiled.is_error():
                raise ParameterError("structured_output", f"the structured output's {constraint.kind} is not valid: "
                                                          f"{matcher_error(compiled)}")
            compiled.compute_bitmask()  # can the tokenizer begin it? (the request then fails before it runs)
            if compiled.is_error():
                raise ParameterError("structured_output", f"this model's tokenizer cannot begin the structured "
                                                          f"output's {constraint.kind}: {matcher_error(compiled)}")
            self._compiled[grammar] = compiled
            if len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
            return compiled


def allowed_tokens(matcher: LLMatcher, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Which tokens `matcher` allows next: a bool tensor [vocab_size]."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return torch.from_numpy(bits[:vocab_size].astype(bool)).to(device)


def matcher_error(matcher: LLMatcher) -> str:
    """A matcher's error: the first line (the rest is a dump of its parser's state), or where our encoder
    refused (_TokensInContext.__call__, reported by llguidance inside a panic's text), its message."""
    error = matcher.get_error()
    refused = _ENCODER_REFUSAL.search(error)
    return refused.group(1) if refused else (error.splitlines() or ["no error"])[0][:500]
