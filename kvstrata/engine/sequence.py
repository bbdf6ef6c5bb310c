"""One request's state inside the engine: its tokens, its place in the cache, its timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.kv.block_hash import BlockHash
from kvstrata.kv.preloaded import Preloaded
from kvstrata.kv.store.prefill_speed import PrefillWork
from kvstrata.model.lora import LoRAAdapter

if TYPE_CHECKING:
    from llguidance import LLMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: dict[int, float]  # the most likely alternatives and their logprobs, likeliest first
    rank: int | None = None  # of the token in its distribution: 1 the likeliest


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    matcher: LLMatcher | None = None  # follows the output where params.structured_output holds it (grammar_matcher.py)
    bad_words: list[tuple[int, ...]] = field(default_factory=list)  # params.bad_words' tokens (bad_words.py)
    arrival_time: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(default_factory=list)  # prompt then output
    status: SequenceStatus = SequenceStatus.WAITING
    # The KV cache holds this many of `token_ids`, in the blocks of `block_table`.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # leading blocks given back under a sliding window (KVCacheManager.release_behind_window): their entries in
    # `block_table` repeat the first block it still holds
    num_released_blocks: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    # speculative decoding: tokens guessed to follow its last one, scheduled with it to be verified in one step
    draft_token_ids: list[int] = field(default_factory=list)
    num_cached_prompt_tokens: int | None = None  # prefix-cache hits at first admission
    # prompt tokens not computed: prefix-cache hits at first admission and KV placed (the store's, a saved
    # context's) before any preemption
    num_reused_prompt_tokens: int | None = None
    # KV of prompt ranges given ready-made (a decoded saved context), placed instead of computed.
    preloaded: list[Preloaded] = field(default_factory=list)
    num_preloaded_tokens: int = 0
    num_store_tokens: int = 0  # prompt tokens whose KV the KV store (below the device pool) supplied
    store_load_end: tuple[float, PrefillWork] | None = None  # when its store load ended, the prefill it left
    store_plan: tuple[float, float] | None = None  # its store load's first adaptive choice: when, seconds predicted
    store_last_plan: tuple[float, float] | None = None  # and its last: when, seconds predicted and stretched
    # separates prefix-cache entries whose KV a plain prefill would not give (built on preloaded KV, or on a LoRA
    # adapter's weights) and those of a tenant (SamplingParams.cache_salt, last)
    cache_salt: bytes | None = None
    # what its chunks' keys in the KV store (below the device pool) are salted with: b"" on the base model, a LoRA
    # adapter's digest and products' dtype on one, and the tenant's salt among them where it gave one; None where
    # it neither looks up nor writes chunks (its KV came ready-made: a saved context's)
    store_salt: bytes | None = b""
    lora: LoRAAdapter | None = None  # the adapter its tokens are computed with; None: the base model
    num_preemptions: int = 0
    output_text: str = ""
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # per prompt position, when asked for: None for the first token (nothing predicts it), then each token's
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    embedding: torch.Tensor | None = None  # float32 [dimensions], once a request that pools (params.pooling) has it
    finish_reason: str | None = None
    error: str | None = None  # why it ended, when finish_reason is "error"
    error_caused_by_input: bool = False  # that error came of what the request asked (a server answers 400)
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def reads_cached_prefix(self) -> bool:
        """Whether KV cached by other requests (the prefix cache, the KV store) may stand in for its prompt's tokens:
        not when it asks for their logprobs, which only computing them gives."""
        return self.params.prompt_logprobs is None

    @property
    def computes_plain_kv(self) -> bool:
        """Whether its KV is what a prefill on the base model gives (not built on a saved context's, nor by a LoRA
        adapter), whatever tenant's salt keeps it apart."""
        return self.store_salt is not None and self.lora is None

    @property
    def constraint_complete(self) -> bool:
        """Whether its structured output is complete and nothing may follow it."""
        return self.matcher is not None and self.matcher.is_stopped()

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet in the KV cache: the prompt's rest, or the one token sampled last step."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_tokens_to_compute(self) -> int:
        """Pending tokens the model must run before the next preloaded range takes over."""
        for segment in self.preloaded:
            if segment.start > self.num_computed_tokens:
                return min(self.num_pending_tokens, segment.start - self.num_computed_tokens)
        return self.num_pending_tokens
