"""What a server operator can set about the HTTP side: queue, input limits, timeouts, chat special tokens, tool
calls the model chooses, a reasoning model's thinking, LoRA adapters loaded by request."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.errors import KvstrataError
from kvstrata.server.reasoning import REASONING_PARSERS
from kvstrata.server.tool_call_parsers import PARSERS

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


@dataclass(frozen=True)
class ServerOptions:
    max_waiting: int = 256  # requests allowed to wait for a slot; beyond it: 503
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a larger body is refused (413) before it is parsed
    max_tokens_limit: int | None = None  # cap on a request's max_tokens; None: the model's context
    read_timeout: float = 30.0  # seconds a client gets to send its request's headers, and then its body
    special_tokens_in_chat: bool = False  # parse special-token text in chat content (trusted clients only)
    trust_request_chat_template: bool = False  # a chat request's own chat_template is rendered (vLLM's flag)
    shutdown_grace: float = 30.0  # seconds in-flight requests get to finish at shutdown
    api_key: str | None = field(default=None, repr=False)  # API requests must carry it (api_key.py); None: open
    # tool_choice "auto" taken, the model's calls parsed from its text in this format (vLLM's two flags)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # chat's thinking handed back apart from the answer (reasoning.py)
    # LoRA adapters loaded and unloaded by request (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter)
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        for name in ("max_waiting", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise KvstrataError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise KvstrataError(f"--max-tokens-limit must be at least 1, got {self.max_tokens_limit}")
        if self.api_key is not None and not (self.api_key.isascii() and self.api_key.isprintable()
                                             and self.api_key == self.api_key.strip()):
            raise KvstrataError("--api-key must be printable ASCII without surrounding spaces (what an HTTP header "
                                "carries)")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise KvstrataError(f"--tool-call-parser {self.tool_call_parser!r} is not known; known: "
                                f"{', '.join(PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise KvstrataError(f"--reasoning-parser {self.reasoning_parser!r} is not known; known: "
                                f"{', '.join(REASONING_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise KvstrataError("--enable-auto-tool-choice needs --tool-call-parser, the format of the model's calls")
        for name in ("read_timeout", "shutdown_grace"):
            if not getattr(self, name) > 0:
                raise KvstrataError(f"--{name.replace('_', '-')} must be a positive number of seconds, "
                                    f"got {getattr(self, name)}")
