"""Structured output: a request's text held to a JSON schema, to any JSON object, to a regular expression, to one of
a list of strings, or to a grammar (Lark, or llama.cpp's GBNF), as vLLM's structured outputs and OpenAI's
`response_format` offer.

This file holds what a request asks (`StructuredOutput`, checked when built). grammar_matcher.py compiles it and
follows each sequence's output; the sampler gives every token the constraint does not allow next -inf.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from llguidance import LLMatcher, grammar_from

from kvstrata.errors import KvstrataError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one constraint. `json`: a JSON schema (an object, or its text); `json_object`: any JSON object;
    `regex`: a regular expression the whole output matches (Rust's syntax, as llguidance reads it); `choice`: the
    output is one of these strings; `grammar`: a Lark or GBNF grammar whose start rule the output matches.
    `any_whitespace` (JSON only): whitespace may stand between JSON's tokens; off, none may (vLLM's
    disable_any_whitespace: `{"a":1}`), which keeps a small model from spending tokens on it."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    any_whitespace: bool = True

    def __post_init__(self) -> None:
        given = self._given()
        if len(given) != 1:
            raise KvstrataError(f"structured output takes exactly one of {', '.join(KINDS)}; got "
                                f"{', '.join(given) if given else 'none'}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as exc:
                raise KvstrataError(f"the JSON schema is not valid JSON: {exc}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise KvstrataError(f"a JSON schema must be a JSON object, got {self.json!r:.200}")
        if self.json_object is not True and self.json_object is not False:
            raise KvstrataError(f"json_object must be true or false, got {self.json_object!r}")
        if self.any_whitespace is not True and self.any_whitespace is not False:
            raise KvstrataError(f"any_whitespace must be true or false, got {self.any_whitespace!r}")
        if not self.any_whitespace and given[0] not in ("json", "json_object"):
            raise KvstrataError(f"any_whitespace applies to JSON (json, json_object), not to {given[0]}")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise KvstrataError(f"a structured output's {kind} must be a non-empty string, got {value!r:.200}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(option, str) and option for option in self.choice):
                raise KvstrataError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r:.200}")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        return self._given()[0]

    def _given(self) -> list[str]:
        return [kind for kind in KINDS if getattr(self, kind) not in (None, False)]

    @functools.cached_property
    def llguidance_grammar(self) -> str:
        """The constraint in llguidance's grammar form; raises KvstrataError where it cannot be read (a GBNF
        grammar that does not convert, a schema that is not JSON). Other faults show when it is compiled. Kept:
        a request's check, and the matcher of each of its choices, look the compiled constraint up by it."""
        try:
            if self.json_object or self.json is not None:
                schema = {"type": "object"} if self.json_object else self.json
                return LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                          overrides={"whitespace_flexible": self.any_whitespace})
            if self.choice is not None:
                return grammar_from("choice", json.dumps(list(self.choice)))
            return grammar_from(self.kind, self.regex if self.regex is not None else self.grammar)
        except ValueError as exc:
            raise KvstrataError(f"the structured output's {self.kind} cannot be read: {exc}") from None
