"""What the engine hands back for a request: text, tokens, finish reason, timings."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstrata.engine.sequence import TokenLogprobs
from kvstrata.kv.preloaded import PreloadedKV


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_output_tokens: int
    num_preemptions: int

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first."""
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    """The request's state when it was built. Output tokens and logprobs are read from the request's
    growing lists when asked for, up to the count they had then: building an output each step copies
    nothing that grows with the output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "error"
    # prompt tokens whose KV was reused, not computed, when it was first scheduled: the prefix cache's, the KV
    # store's, a saved context's (OpenAI's usage.prompt_tokens_details.cached_tokens)
    num_cached_tokens: int
    metrics: RequestMetrics
    new_text: str = ""  # streaming: text released since the previous output of this request
    new_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list, repr=False)  # prompt then output, shared
    all_logprobs: list[TokenLogprobs] | None = field(default=None, repr=False)  # shared; None: not asked for
    # per prompt position (None for the first token), once the prompt is computed; None: not asked for
    prompt_logprobs: list[TokenLogprobs | None] | None = field(default=None, repr=False)
    error: str | None = None  # what ended the request, when finish_reason is "error"
    error_caused_by_input: bool = False  # that error came of what the request asked (its constraint), not a fault
    # asked for with SamplingParams.keep_tail_kv: the KV of the tokens after the last full block, which a request
    # continuing them takes as preloaded KV; None where they fill whole blocks
    tail_kv: PreloadedKV | None = field(default=None, repr=False)
    embedding: torch.Tensor | None = field(default=None, repr=False)  # float32 [dimensions]: a pooling request's

    @property
    def token_ids(self) -> list[int]:
        start = len(self.prompt_token_ids)
        return self.all_token_ids[start : start + self.metrics.num_output_tokens]

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return None if self.all_logprobs is None else self.all_logprobs[: self.metrics.num_output_tokens]
