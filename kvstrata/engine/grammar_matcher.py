"""Structured output's run-time half: a request's constraint (structured_output.py) compiled by llguidance into a
matcher that follows its sequence's output and, before each token, tells which tokens may come next.

llguidance needs every token as the bytes it adds to the text. It reads them from most tokenizers' own
description (byte-level BPE such as the default model's); for one it cannot read (SentencePiece's Metaspace
decoder, for instance), each token is decoded after a fixed token, so that it reads as it does inside a text,
which is how the detokenizer renders an output.

A matcher costs a compilation (a large JSON schema: a tenth of a second and more), so compiled constraints are kept
(the last COMPILED_KEPT) and each sequence gets a copy: the `n` choices of one request, and later requests with the
same schema, compile once.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict

import numpy as np
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from kvstrata.engine.structured_output import StructuredOutput
from kvstrata.errors import KvstrataError, ParameterError
from kvstrata.model.tokenizer import Tokenizer

COMPILED_KEPT = 64
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces
NO_TOKEN_HOLDS = "no token of this tokenizer holds byte"
# llguidance reports an exception raised in our encoder inside the text of a Rust panic
_ENCODER_REFUSAL = re.compile(rf"ValueError\('({NO_TOKEN_HOLDS} 0x[0-9a-f]+)'\)")
log = logging.getLogger("kvstrata.engine")


class _TokensInContext:
    """What llguidance's TokenizerWrapper reads of a tokenizer it cannot read itself: every token's bytes as they
    read inside a text, the special tokens, and an encoder into tokens of those bytes."""

    def __init__(self, tokenizer: Tokenizer, eos_token_id: int):
        backend = tokenizer.backend
        anchor = tokenizer.encode("a", add_special_tokens=False)[-1]  # any plain token will do
        lead = backend.decode([anchor], skip_special_tokens=False)
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for token in range(backend.get_vocab_size(with_added_tokens=True)):
            piece = backend.id_to_token(token)
            if piece in tokenizer.special_token_texts:
                self.special_token_ids.append(token)
                self.tokens.append(piece.encode())
            else:
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
        """The fewest tokens whose bytes make `text` (the tokenizer's own encoder will not do: a Metaspace one
        puts a space before the text). ValueError where no tokens make it."""
        data = text.encode() if isinstance(text, str) else text
        # fewest[i]: the fewest tokens that make data[:i], and the last of them
        fewest: list[tuple[int, int] | None] = [(0, -1)] + [None] * len(data)
        for end in range(1, len(data) + 1):
            for start in range(max(0, end - self._longest), end):
                token = self._ids.get(data[start:end])
                if token is not None and fewest[start] is not None and (
                        fewest[end] is None or fewest[start][0] + 1 < fewest[end][0]):
                    fewest[end] = (fewest[start][0] + 1, token)
        if fewest[-1] is None:
            unreachable = next(i for i in range(len(data)) if fewest[i + 1] is None)
            raise ValueError(f"{NO_TOKEN_HOLDS} {data[unreachable]:#x}")
        tokens, end = [], len(data)
        while end:
            token = fewest[end][1]
            tokens.append(token)
            end -= len(self.tokens[token])
        return tokens[::-1]


def llguidance_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: set[int]) -> LLTokenizer:
    """The tokenizer as llguidance sees it, over the model's `vocab_size` logits (tokens past the tokenizer's are
    never allowed); any of `eos_token_ids` may end a complete output."""
    eos = sorted(eos_token_ids)
    if not eos:
        raise KvstrataError("structured output needs the model's end-of-sequence token; this model names none")
    try:
        return LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    except ValueError as exc:
        log.info("llguidance does not read this tokenizer (%s); its tokens are decoded in context instead", exc)
        wrapper = TokenizerWrapper(_TokensInContext(tokenizer, eos[0]))
        return LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)


class GrammarCompiler:
    """One per engine: compiles requests' constraints into matchers. Thread-safe: a server checks requests in
    worker threads while the engine thread adds them; compiling holds no lock, so a slow schema keeps no one else
    waiting (two threads may compile one constraint at once, and one copy is kept)."""

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
        try:
            grammar = constraint.llguidance_grammar
        except KvstrataError as exc:
            raise ParameterError("structured_output", str(exc)) from None
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar]
        compiled = LLMatcher(self._llguidance_tokenizer(), grammar, log_level=0)
        if compiled.is_error():
            raise ParameterError("structured_output", f"the structured output's {constraint.kind} is not valid: "
                                                      f"{matcher_error(compiled)}")
        compiled.compute_bitmask()  # can the tokenizer begin it? (the request then fails before it runs)
        if compiled.is_error():
            raise ParameterError("structured_output", f"the structured output's {constraint.kind} cannot begin: "
                                                      f"{matcher_error(compiled)}")
        with self._lock:
            self._compiled[grammar] = compiled
            if len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return compiled

    def _llguidance_tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            raise ParameterError("structured_output", "structured output needs the model's tokenizer; this model "
                                                      "has none")
        with self._lock:
            if self._lltokenizer is None:
                try:
                    self._lltokenizer = llguidance_tokenizer(self._tokenizer, self._vocab_size, self._eos_token_ids)
                except KvstrataError as exc:
                    raise ParameterError("structured_output", str(exc)) from None
            return self._lltokenizer


def allowed_tokens(matcher: LLMatcher, vocab_size: int) -> np.ndarray:
    """Which tokens `matcher` allows next: a bool array [vocab_size], on the host."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


def matcher_error(matcher: LLMatcher) -> str:
    """Why a matcher stopped: the first line of its error with the reason a later line gives (a parse error draws
    where it is between them; after them comes a dump of the parser's state), or where our encoder refused
    (_TokensInContext.__call__), its message."""
    error = matcher.get_error()
    if not error:
        return "it allows no token"
    refused = _ENCODER_REFUSAL.search(error)
    if refused:
        return refused.group(1)
    first, *rest = error.split("\n<state>")[0].splitlines()
    if first == "NoExtensionBias":  # the token mask came out empty
        return "no token can begin or extend it (it matches no text, or none this tokenizer's tokens spell)"
    reason = next((line.removeprefix("error: ") for line in rest if line.startswith("error: ")), None)
    return (first if reason is None else f"{first} {reason}")[:500]
