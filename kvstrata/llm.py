"""Offline API: `LLM().generate(prompts, params)` and a streaming iterator over one request."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tqdm import tqdm

from kvstrata.cachegen.context import DEFAULT_CHUNK_TOKENS, ContextLoad, SavedContext, SaveReport, save_context
from kvstrata.cachegen.levels import CACHEGEN_LEVELS
from kvstrata.cachegen.profile import CodecProfile
from kvstrata.config import EngineConfig
from kvstrata.engine.beam_search import BeamSearchOutput, BeamSearchParams, new_searches, run_searches
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.lora_request import LoRARequest, with_adapters
from kvstrata.engine.outputs import RequestOutput
from kvstrata.engine.pooling_params import PoolingParams
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.errors import KvstrataError

Prompt = str | list[int]
Messages = list[dict]


class LLM:
    """An engine for offline use. Keyword arguments are `EngineConfig` fields (model, device, ...)."""

    def __init__(self, model: str | None = None, **options):
        self.engine = LLMEngine(EngineConfig(model=model, **options))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        context: str | Path | SavedContext | None = None,
        context_level: str | None = None,
        recompute_chunks: Iterable[int] = (),
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched by the scheduler; outputs in the prompts' order.

        With `context` (a file from `save_context`), every prompt continues that context: its chunks
        are decoded into the KV cache at `context_level` (default: the best stored) instead of being
        prefilled, except `recompute_chunks`, which are prefilled from their tokens. A prompt the engine
        cannot finish (its context turned out corrupt) comes back with finish_reason "error" and `error`
        saying why; the other prompts are unaffected.

        `lora_request` (vLLM's): the LoRA adapter every prompt runs on, or one (or None, the base model) per prompt;
        the engine needs enable_lora. `priority` (vLLM's): each prompt's priority, lower first, under
        scheduling_policy "priority" (SamplingParams.priority).
        """
        prompts = _as_list(prompts)
        params_list = with_adapters(self.engine, self._params_per_prompt(params, len(prompts)), lora_request)
        params_list = _with_priorities(params_list, priority)
        arrival = time.perf_counter()  # time to first token counts the context's decoding too
        load = ContextLoad.prepare(self.engine, context, context_level, recompute_chunks)
        ids = [self._add(p, sp, load, arrival) for p, sp in zip(prompts, params_list)]
        return self._run_to_completion(ids, use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Each prompt's embedding (`RequestOutput.embedding`, float32), in the prompts' order: the final hidden
        state of its last token, normalized unless `pooling_params` (one, or one per prompt) says otherwise
        (engine/pooling_params.py). The prompts are scheduled as any others are: batched with whatever runs, a
        prefix the prefix cache or the KV store holds read rather than computed (only from requests with the same
        `cache_salt`: SamplingParams.cache_salt, which generate takes in its params)."""
        prompts = _as_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        if len(pooling_params) != len(prompts) or not all(isinstance(p, PoolingParams) for p in pooling_params):
            raise KvstrataError(f"got {len(pooling_params)} pooling params for {len(prompts)} prompts; give one "
                                f"PoolingParams or one per prompt")
        params = [SamplingParams(max_tokens=1, pooling=pooling, cache_salt=cache_salt) for pooling in pooling_params]
        params = _with_priorities(with_adapters(self.engine, params, lora_request), priority)
        arrival = time.perf_counter()
        ids = [self.engine.add_request(prompt, one, arrival_time=arrival) for prompt, one in zip(prompts, params)]
        return self._run_to_completion(ids, use_tqdm)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """The likeliest continuations of each prompt by beam search, as transformers' `generate(num_beams=...)`
        finds them (engine/beam_search.py); outputs in the prompts' order, each with its best beams first."""
        if lora_request is not None:
            params = dataclasses.replace(params, lora_name=self.engine.load_lora(lora_request.lora_name,
                                                                                 lora_request.lora_path).name)
        searches = new_searches(self.engine, [self.engine.tokenize(prompt) for prompt in _as_list(prompts)], params)
        run_searches(self.engine, searches)
        return [search.output(self.tokenizer) for search in searches]

    def save_context(
        self,
        context: Prompt,
        path: str | Path,
        levels: Sequence[str] = CACHEGEN_LEVELS,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        profile: CodecProfile | None = None,
    ) -> SaveReport:
        """Prefill `context` once and save its KV cache as CacheGen chunks at every level in `levels`."""
        return save_context(self.engine, self.engine.tokenize(context), path, levels, chunk_tokens, profile)

    def _add(self, prompt: Prompt, params: SamplingParams, load: ContextLoad | None, arrival: float) -> str:
        if load is None:
            return self.engine.add_request(prompt, params, arrival_time=arrival)
        token_ids = load.token_ids + self.engine.tokenize(prompt)
        return self.engine.add_request(token_ids, params, arrival_time=arrival, preloaded=load.preloaded,
                                       cache_salt=load.salt)

    def chat(
        self,
        conversations: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Like `generate`, for chat conversations (lists of {"role", "content"}) under the chat template. With
        `continue_final_message`, each conversation's last message (an answer begun) is continued rather than
        followed by a new assistant turn; `tools` (OpenAI's function definitions) are the template's to render, and
        `chat_template_kwargs` further variables it reads (e.g. `{"enable_thinking": False}` for Qwen3)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.chat_prompt(c, continue_final_message, tools, chat_template_kwargs) for c in conversations]
        return self.generate(prompts, params, use_tqdm, lora_request=lora_request, priority=priority)

    def chat_prompt(self, messages: Messages, continue_final_message: bool = False,
                    tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
        if self.tokenizer is None:
            raise KvstrataError("this model has no tokenizer, so it cannot take chat messages")
        return self.tokenizer.encode_chat(messages, add_generation_prompt=not continue_final_message,
                                          continue_final_message=continue_final_message, tools=tools,
                                          template_kwargs=chat_template_kwargs)

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        context: str | Path | SavedContext | None = None,
        context_level: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield the request's output each time it gets new tokens; the last one has finished=True."""
        arrival = time.perf_counter()
        load = ContextLoad.prepare(self.engine, context, context_level, ())
        [params] = with_adapters(self.engine, [params or self.engine.default_sampling_params()], lora_request)
        request_id = self._add(prompt, params, load, arrival)
        try:
            while True:
                for output in self.engine.step():
                    if output.request_id == request_id:
                        yield output
                        if output.finished:
                            return
        finally:
            self.engine.abort(request_id)  # a consumer that stops early frees the request's blocks

    def _run_to_completion(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), disable=not use_tqdm, desc="generating") as bar:
            while len(finished) < len(request_ids):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[r] for r in request_ids]

    def _params_per_prompt(self, params, count: int) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or self.engine.default_sampling_params()] * count
        if len(params) != count:
            raise KvstrataError(f"got {len(params)} sampling params for {count} prompts; give one or one per prompt")
        return list(params)


def _with_priorities(params: list[SamplingParams], priority: Sequence[int] | None) -> list[SamplingParams]:
    """`params` (one per prompt) with each prompt's priority, where one is given per prompt."""
    if priority is None:
        return params
    if isinstance(priority, int) or len(priority) != len(params):
        raise KvstrataError(f"priority {priority!r:.200} is not a list of one priority per prompt ({len(params)})")
    return [dataclasses.replace(one, priority=value) for one, value in zip(params, priority)]


def _as_list(prompts: Prompt | Sequence[Prompt]) -> Sequence[Prompt]:
    """One prompt (text or token ids) as a list of one; a list of prompts as it is."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return prompts
