"""Tokenizer from a checkpoint directory: tokenizer.json, its config, and the chat template."""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path

import jinja2
import jinja2.defaults
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers

from kvstrata.errors import KvstrataError

_CONTENT_MARK = "\ue000"  # a private-use character: no chat template writes it
# What a chat template is given apart from the caller's template_kwargs: its arguments and jinja's and transformers'
# globals, which a caller's variable of the same name would hide.
TEMPLATE_ARGUMENTS = ("messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token",
                      "raise_exception", "strftime_now", *jinja2.defaults.DEFAULT_NAMESPACE)


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _encode_without_gil(backend: tokenizers.Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    # encode_batch releases the GIL while it works and encode does not (tokenizers 0.23): a server that
    # tokenizes in a worker thread keeps answering only with the former (/health stalled 0.5 s per 660 KB).
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def _raise_template_error(message: str):
    raise KvstrataError(f"chat template rejected the messages: {message}")


def _to_json(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' tojson: jinja's own escapes <, >, & and ' for HTML, and templates write tool schemas with it.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class _GenerationBlocks(jinja2.ext.Extension):
    """transformers' {% generation %}...{% endgeneration %}, which marks an assistant's text for training: here its
    body renders as it is."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        line = next(parser.stream).lineno
        return jinja2.nodes.Scope(parser.parse_statements(("name:endgeneration",), drop_needle=True)).set_lineno(line)


def _template_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """What transformers' apply_chat_template renders in, so that a model's template renders here the same:
    {% break %} and {% continue %}, {% generation %}, its tojson, raise_exception and strftime_now (the date some
    templates write)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                        extensions=[jinja2.ext.loopcontrols, _GenerationBlocks])
    env.filters["tojson"] = _to_json
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now
    return env


def _compiled_template(template: str, what: str) -> jinja2.Template:
    try:
        return _template_environment().from_string(template)
    except jinja2.TemplateError as exc:
        raise KvstrataError(f"{what} cannot be read: {exc}") from exc
    except (RecursionError, MemoryError):  # blocks nested deeper than jinja's parser goes
        raise KvstrataError(f"{what} cannot be read: it nests too deep") from None


def _text_beside_contents(messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None) -> str:
    """All the text a chat template may write besides the messages' contents: their other fields (tool calls), the
    tools and the caller's variables."""
    others = [{key: value for key, value in m.items() if key != "content"} for m in messages]
    return json.dumps([others, tools, template_kwargs], ensure_ascii=False, default=str)


def read_chat_template(value: str) -> str:
    """A chat template given in place of the model's, as vLLM's --chat-template takes it: a file's path, or the
    template itself, told apart by its braces or line breaks (kept as given: vLLM would also turn the escape \\n
    into a line break). Read again, what it returns is returned as it is (a template holds a brace or a line
    break)."""
    try:
        is_file = Path(value).is_file()
    except (OSError, ValueError):  # a template too long for a file name, or holding a NUL
        is_file = False
    if is_file:
        try:
            return Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KvstrataError(f"cannot read the chat template file {value}: {exc}") from exc
    if any(mark in value for mark in "{}\n"):
        return value
    raise KvstrataError(f"chat_template {value[:80]!r} is neither a file nor a template (which holds a brace or a "
                        f"line break)")


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, config: dict, chat_template: str | None):
        self.backend = backend
        self.config = config  # tokenizer_config.json's fields
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

    def with_chat_template(self, template: str) -> Tokenizer:
        """This tokenizer with `template` as its chat template, which must compile."""
        tokenizer = Tokenizer(self.backend, self.config, template)
        tokenizer._compiled_template = _compiled_template(template, "the chat template given")
        return tokenizer

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return _encode_without_gil(self.backend, text, add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """The template's text. `template_kwargs` are further variables it reads (e.g. Qwen3's `enable_thinking`),
        as transformers' keyword arguments of this name are; they cannot stand for the ones named here."""
        if self.chat_template is None:
            raise KvstrataError("this model has no chat template; send a plain prompt instead")
        taken = sorted((template_kwargs or {}).keys() & set(TEMPLATE_ARGUMENTS))
        if taken:
            raise KvstrataError(f"chat template variables {', '.join(taken)} are the template's own; template_kwargs "
                                f"may not set them")
        variables = {
            "bos_token": self.backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else "",
            "eos_token": self.backend.id_to_token(self.eos_token_id) if self.eos_token_id is not None else "",
            **(template_kwargs or {}),
        }
        if self._compiled_template is None:
            self._compiled_template = _compiled_template(self.chat_template, "this model's chat template")
        try:
            return self._compiled_template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, **variables
            )
        except KvstrataError:
            raise
        except Exception as exc:  # any error of the template's code (a variable of the wrong type) is the input's
            raise KvstrataError(f"chat template failed on the messages: {type(exc).__name__}: {exc}") from exc

    @functools.cached_property
    def special_token_texts(self) -> frozenset[str]:
        return frozenset(t.content for t in self.backend.get_added_tokens_decoder().values() if t.special)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """No token covers more characters of text than its longest vocabulary entry: each character of a
        byte-level entry stands for one byte, and a text character is at least one byte."""
        return max(len(text) for text in self.backend.get_vocab(with_added_tokens=True))

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    special_tokens_in_content: bool = False, continue_final_message: bool = False,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """The rendered template's tokens. The template's own special tokens are parsed as such; the same
        text inside a message's content is encoded as plain text unless `special_tokens_in_content`, so a
        user cannot forge a role boundary (transformers parses it; trusted clients may ask for that). With
        `continue_final_message` the rendering stops right after the last message's content, which the model then
        continues (an assistant's answer begun by the client), as transformers' option of that name does.
        `tools` (OpenAI's function definitions) are the template's to render, as transformers passes them, and so are
        `template_kwargs` (apply_chat_template)."""
        if continue_final_message and add_generation_prompt:
            raise KvstrataError("continue_final_message continues the last message; add_generation_prompt would "
                                "open another: ask for one of them")
        contents = [m["content"] for m in messages]
        beside = _text_beside_contents(messages, tools, template_kwargs)
        if not special_tokens_in_content:
            self._refuse_role_boundaries(beside)
        if special_tokens_in_content or not any(s in c for c in contents for s in self.special_token_texts):
            rendered = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs)
            if continue_final_message:  # cut where transformers cuts: after the last copy of the final content
                final = contents[-1].strip()
                if final not in rendered:
                    raise KvstrataError("the chat template does not write the last message's content, so it cannot "
                                        "be continued")
                rendered = rendered[: rendered.rindex(final) + len(final)]
            return self.encode(rendered, add_special_tokens=False)
        # Render with each content replaced by a marker, then encode the template's text and the contents apart.
        if _CONTENT_MARK in beside:
            raise KvstrataError("the tools, tool calls or template variables hold U+E000, a character the chat "
                                "template's rendering reserves where a message's content holds special-token text")
        marked = [{**m, "content": f"{_CONTENT_MARK}{i}{_CONTENT_MARK}"} for i, m in enumerate(messages)]
        pieces = self.apply_chat_template(marked, add_generation_prompt, tools, template_kwargs).split(_CONTENT_MARK)
        if continue_final_message:  # up to the final content's marker (odd pieces are the contents' numbers)
            final = [i for i in range(1, len(pieces), 2) if pieces[i] == str(len(messages) - 1)]
            if not final:
                raise KvstrataError("the chat template does not write the last message's content, so it cannot "
                                    "be continued")
            pieces = pieces[: final[-1] + 1]
        token_ids = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                token_ids += self.encode(piece, add_special_tokens=False)
            else:
                token_ids += _encode_without_gil(self._literal_backend, contents[int(piece)], False)
        return token_ids

    def _refuse_role_boundaries(self, beside: str) -> None:
        """What the template writes besides message contents (`beside`) is encoded as the template's own text, so it
        may not hold the text of a special token the template itself writes (a role boundary, such as <|im_start|>,
        or the BOS and EOS tokens): that would be a forged turn."""
        forged = sorted(s for s in self._template_special_texts if s in beside)
        if forged:
            raise KvstrataError(f"special-token text {forged[0]!r} in the tools, tool calls or template variables: "
                                f"only a message's content may carry it (as plain text)")

    @functools.cached_property
    def _template_special_texts(self) -> frozenset[str]:
        """The special tokens a turn is made of: those the chat template writes, and BOS and EOS."""
        ends = {self.backend.id_to_token(i) for i in (self.bos_token_id, self.eos_token_id) if i is not None}
        return frozenset(s for s in self.special_token_texts if s in (self.chat_template or "") or s in ends)

    @functools.cached_property
    def _literal_backend(self) -> tokenizers.Tokenizer:
        """A copy of the backend that encodes special-token text as plain text (the flag is the backend's
        own state, so the shared backend is never switched while other threads encode)."""
        backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend
