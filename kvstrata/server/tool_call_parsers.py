"""--tool-call-parser's choices: the model formats whose calls tool_choice "auto" reads (vLLM's names)."""

from __future__ import annotations

from kvstrata.server.auto_tool_calls import AutoToolCalls
from kvstrata.server.hermes_tool_calls import HermesToolCalls
from kvstrata.server.llama3_json_tool_calls import Llama3JsonToolCalls
from kvstrata.server.mistral_tool_calls import MistralToolCalls
from kvstrata.server.pythonic_tool_calls import PythonicToolCalls

PARSERS: dict[str, type[AutoToolCalls]] = {"hermes": HermesToolCalls, "llama3_json": Llama3JsonToolCalls,
                                           "mistral": MistralToolCalls, "pythonic": PythonicToolCalls}
