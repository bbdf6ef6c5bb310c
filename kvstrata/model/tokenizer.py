"""Tokenizer from a checkpoint directory: tokenizer.json, its config, and the chat template."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.sandbox
import tokenizers

from kvstrata.errors import KvstrataError


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _raise_template_error(message: str):
    raise KvstrataError(f"chat template rejected the messages: {message}")


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, config: dict, chat_template: str | None):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = self._token_id(_token_text(config.get("bos_token")))
        self.eos_token_id = self._token_id(_token_text(config.get("eos_token")))
        self._compiled_template = None

    @classmethod
    def from_directory(cls, path: Path) -> Tokenizer | None:
        """The directory's tokenizer, or None when it ships none (token-id prompts still work)."""
        if not (path / "tokenizer.json").is_file():
            return None
        config_file = path / "tokenizer_config.json"
        try:
            backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except Exception as exc:  # tokenizers raises bare Exceptions, json ValueErrors, files OSErrors
            raise KvstrataError(f"cannot read the tokenizer in {path}: {exc}") from exc
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        return cls(backend, config, template)

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise KvstrataError("this model has no chat template; send a plain prompt instead")
        if self._compiled_template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._compiled_template = env.from_string(self.chat_template)
        specials = {
            "bos_token": self.backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else "",
            "eos_token": self.backend.id_to_token(self.eos_token_id) if self.eos_token_id is not None else "",
        }
        try:
            return self._compiled_template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **specials
            )
        except jinja2.TemplateError as exc:
            raise KvstrataError(f"chat template failed on the messages: {exc}") from exc

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The rendered template already holds any special tokens the model expects.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)
