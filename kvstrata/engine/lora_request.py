"""vLLM's way of naming a LoRA adapter for offline requests: `LLM.generate(prompts, params,
lora_request=LoRARequest("sql", 1, "/adapters/sql-lora"))`. The adapter is loaded on first use and kept under its
name; requests reach it through SamplingParams.lora_name."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.errors import KvstrataError


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # vLLM's id of the adapter; kvstrata names adapters by lora_name alone
    lora_path: str


def with_adapters(engine, params: list[SamplingParams],
                  lora_request: LoRARequest | Sequence[LoRARequest | None] | None) -> list[SamplingParams]:
    """`params` (one per prompt) naming each prompt's adapter, loaded in `engine` where it was not: one
    LoRARequest for every prompt, or one (or None) per prompt."""
    if lora_request is None:
        return params
    requests = [lora_request] * len(params) if isinstance(lora_request, LoRARequest) else list(lora_request)
    if len(requests) != len(params):
        raise KvstrataError(f"got {len(requests)} LoRA requests for {len(params)} prompts; give one or one per prompt")
    named = []
    for sampling, request in zip(params, requests):
        if request is not None:
            engine.load_lora(request.lora_name, request.lora_path)
            sampling = dataclasses.replace(sampling, lora_name=request.lora_name)
        named.append(sampling)
    return named
