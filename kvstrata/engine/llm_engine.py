"""The step loop: requests in, one scheduled packed batch per step, outputs back.

`add_request` / `step` / `abort` form the streaming interface the server builds on; `LLM`
wraps them for offline use.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.cachegen.profile import shipped_profile
from kvstrata.config import EngineConfig
from kvstrata.engine.bad_words import bad_word_token_ids
from kvstrata.engine.direct_forward import compute_kv
from kvstrata.engine.draft_verification import (
    accepted_tokens,
    draft_histories,
    rejected_draft_positions,
    sequence_rows,
    verifies,
)
from kvstrata.engine.freed_memory import keep_freed_memory
from kvstrata.engine.grammar_matcher import GrammarCompiler, allowed_tokens, matcher_error
from kvstrata.engine.important_prefix_load import ImportantLoading
from kvstrata.engine.kv_offload_setup import attention_policy
from kvstrata.engine.kv_setup import engine_storage_layout, kv_format_name, stored_form
from kvstrata.engine.kv_store_link import KVStoreLink, make_store
from kvstrata.engine.model_runner import ModelRunner, PromptRows
from kvstrata.engine.ngram_proposer import NgramProposer
from kvstrata.engine.output_processor import OutputProcessor
from kvstrata.engine.outputs import RequestOutput
from kvstrata.engine.penalties import Histories
from kvstrata.engine.sampler import finite_rows, sample
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.engine.scheduler import PrefillFirstScheduler, SarathiScheduler, Scheduler, StaticScheduler
from kvstrata.engine.scheduler.policy import scheduling_policy
from kvstrata.engine.sequence import Sequence, SequenceStatus
from kvstrata.engine.torch_threads import default_threads, keep_torch_threads, use_torch_threads
from kvstrata.errors import KvstrataError, ParameterError, RequestFailed
from kvstrata.kv.block_hash import tenant_salt
from kvstrata.kv.cache_factory import StorageLayout
from kvstrata.kv.cache_manager import KVCacheManager
from kvstrata.kv.preloaded import Preloaded, PreloadedKV
from kvstrata.kv.slots import token_slots
from kvstrata.kv.store.prefill_speed import PrefillSpeed, PrefillWork
from kvstrata.kv.window_blocks import window_in_force
from kvstrata.model.linear_layers import multiplied_weights
from kvstrata.model.loader import LoadedModel, load_model
from kvstrata.model.lora import LoRAAdapter
from kvstrata.model.lora_layers import LoRALayers
from kvstrata.model.native_decode import NativeDecode
from kvstrata.model.tokenizer import Tokenizer

MAX_STEP_STATS = 100_000
log = logging.getLogger("kvstrata.engine")


@dataclass
class StepStats:
    prefill_tokens: int
    decode_tokens: int
    num_seqs: int
    num_preempted: int
    seconds: float
    num_draft_tokens: int = 0  # speculative decoding: drafts verified in the step
    num_accepted_tokens: int = 0  # and accepted


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise KvstrataError("device 'cuda' was asked for but torch sees no CUDA GPU; use --device cpu")
    return torch.device(name)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        self.threads = config.threads or default_threads()
        use_torch_threads(self.threads)
        if config.keep_freed_memory and not keep_freed_memory():
            log.info("keep_freed_memory: not set (glibc's malloc only; this C library is another, or it refused)")
        self.device = _device(config.device)
        dtype = getattr(torch, config.dtype)
        self.loaded = loaded or load_model(config.model, self.device, dtype, config.weights, config.max_model_len)
        if config.compile:
            self._compile_model()
        if hasattr(self.loaded.model, "native_decode"):
            self.loaded.model.native_decode = NativeDecode.for_model(self.loaded.model) if config.native_decode else None
        self.lora = self._lora_layers()  # None unless LoRA adapters are enabled
        self.tokenizer = self._tokenizer()
        self.sampling_defaults = self._sampling_defaults()  # for the sampling settings a request leaves unset
        # bad words' tokens, found once for a request (in the server's worker thread, which checks it first) and
        # for the latest lists
        self._bad_word_tokens_of = functools.lru_cache(maxsize=64)(functools.partial(bad_word_token_ids,
                                                                                       self.tokenizer))
        self.max_model_len = self._max_model_len()
        self._check_rope_fits_context()
        layout = engine_storage_layout(self, dtype)
        num_blocks = self._num_blocks(layout)
        # the concurrency counts whole blocks, as vLLM's start-up line does (and KIVI's window beside each request)
        request_blocks = -(-self._tokens_a_request_holds() // config.block_size) + layout.blocks_beside_a_sequence
        log.info("KV cache: %s tokens (%d blocks of %d) in %s, %.1f bytes a token; maximum concurrency for "
                 "%d-token requests: %.2fx", f"{num_blocks * config.block_size:,}", num_blocks, config.block_size,
                 kv_format_name(config, dtype), layout.bytes_per_token, self.max_model_len,
                 num_blocks / request_blocks)
        # the KV storage: on the compute device, or a pool in host memory under --kv-offload full|infinigen
        in_host_pool = config.kv_offload in ("full", "infinigen")
        self.kv_cache = layout.build(num_blocks, torch.device("cpu") if in_host_pool else self.device)
        # which cached tokens each layer reads, and (offload) what is copied to the device for it
        self.attention = attention_policy(self, layout, num_blocks * config.block_size)
        # H2O's eviction state is per cache slot: its blocks cannot be shared between sequences
        self.kv_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching and config.kv_offload != "h2o",
            on_allocate=self.attention.reset_blocks, write_kv=self.attention.write,
            namespace=f"{self.model_fingerprint}/{self._weights_tag()}/{stored_form(config, dtype)}/".encode(),
            window=self.attention.window,
            borrower=self.kv_cache if layout.block_group > 1 else None,
        )
        self.attention.attach_block_pool(self.kv_manager.pool)
        self.kv_store = self.make_kv_store_link()  # tiers below the device pool, or None
        self.scheduler = self._make_scheduler()
        self.proposer = None  # speculative decoding's drafts
        if config.num_speculative_tokens:
            self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                        config.prompt_lookup_max)
            self.scheduler.propose_drafts = self._drafts_for
        self.runner = ModelRunner(self.loaded.model, self.attention, config.block_size, self.device,
                                  max_blocks_per_seq=-(-self.max_model_len // config.block_size),
                                  max_num_seqs=config.max_num_seqs)
        self.outputs = OutputProcessor(self.tokenizer, self._eos_token_ids(), self.max_model_len)
        self.grammars = GrammarCompiler(self.tokenizer, self.loaded.config.vocab_size, self.outputs.eos_token_ids)
        # The latest steps only, so a long-running server's memory stays bounded.
        self.step_stats: deque[StepStats] = deque(maxlen=MAX_STEP_STATS)
        self._sequences: dict[str, Sequence] = {}
        self._seq_ids = itertools.count()

    # --- set-up -------------------------------------------------------------------------------

    def _lora_layers(self) -> LoRALayers | None:
        if not self.config.lora_enabled:
            return None
        lora = LoRALayers.of(self.loaded.model, self.loaded.config, self.device, getattr(torch, self.config.lora_dtype))
        for name, path in self.config.lora_module_paths():
            lora.load(name, path)
        return lora

    def load_lora(self, name: str, path: str) -> LoRAAdapter:
        """Load a PEFT LoRA adapter under `name` (requests name it in SamplingParams.lora_name); the adapter loaded
        under that name already where the path is the same."""
        if self.lora is None:
            raise KvstrataError("LoRA adapters are not enabled in this engine; start it with enable_lora (or "
                                "lora_modules)")
        return self.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget LoRA adapter `name` (requests already running on it finish on it)."""
        if self.lora is None:
            raise KvstrataError("LoRA adapters are not enabled in this engine")
        self.lora.unload(name)

    def _request_adapter(self, params: SamplingParams) -> LoRAAdapter | None:
        if params.lora_name is None:
            return None
        if self.lora is None:
            raise ParameterError("lora_name", f"this request names LoRA adapter {params.lora_name!r}, but LoRA "
                                              "adapters are not enabled in this engine (enable_lora, lora_modules)")
        try:
            return self.lora.adapter(params.lora_name)
        except KvstrataError as exc:
            raise ParameterError("lora_name", str(exc)) from None

    def _max_model_len(self) -> int:
        limit = self.loaded.config.max_position_embeddings
        asked = self.config.max_model_len
        if asked is not None and asked > limit:
            raise KvstrataError(f"max_model_len {asked} exceeds the model's context of {limit} tokens")
        return asked or limit

    def _check_rope_fits_context(self) -> None:
        """A model loaded for another engine (`loaded`) rotates keys as that engine's context asked: under LongRoPE
        the factors for contexts up to the pretrained length or past it (ModelConfig.for_context)."""
        mc = self.loaded.config
        if mc.for_context(self.max_model_len).rope_freq_factors == mc.rope_freq_factors:
            return
        pretrained = mc.long_rope.original_max_position_embeddings
        wanted = "short" if self.max_model_len <= pretrained else "long"
        raise KvstrataError(f"max_model_len {self.max_model_len} takes LongRoPE's {wanted} factors (the short ones "
                            f"serve up to {pretrained} tokens), but the model was loaded with the others; load it "
                            f"with context_len {self.max_model_len}")

    def _tokens_a_request_holds(self) -> int:
        """The most tokens of KV one request holds at once: its whole context, max_model_len; or, served past a
        sliding window under SARATHI, its window, the chunk in flight and a block where they meet, since the blocks
        behind the window go back after each step. Not so with a KV store (it copies a prompt whole before its
        blocks go back) nor under the schedulers that compute a prompt in one step."""
        c, window = self.config, window_in_force(self.loaded.config.sliding_window, self.max_model_len)
        if window is None or c.scheduler != "sarathi" or c.kv_store is not None:
            return self.max_model_len
        return min(self.max_model_len, window + c.chunk_size + c.block_size)

    def _num_blocks(self, layout: StorageLayout) -> int:
        bs, group = self.config.block_size, layout.block_group
        block_bytes = math.ceil(bs * layout.bytes_per_token)
        num_blocks = self.config.kv_cache_memory // block_bytes // group * group
        holds = self._tokens_a_request_holds()
        needed = -(-holds // bs) + layout.blocks_beside_a_sequence
        if num_blocks < needed:
            least = -(-needed // group) * group * block_bytes
            request, lower = f"of max_model_len {self.max_model_len}", "--max-model-len"
            if holds < self.max_model_len:
                request = (f"past its sliding window ({self.loaded.config.sliding_window} tokens, a chunk of "
                           f"{self.config.chunk_size} and a block of {bs})")
                lower = "--chunk-size"
            window = ""
            if layout.blocks_beside_a_sequence:
                window = f" (and KIVI's float16 window beside it, {layout.blocks_beside_a_sequence} blocks)"
            raise KvstrataError(
                f"kv_cache_memory of {self.config.kv_cache_memory} bytes holds {num_blocks * bs} tokens, fewer than "
                f"one request {request} holds{window}; give at least {least} bytes ({least / 2**20:.1f} MiB) or "
                f"lower {lower}"
            )
        return num_blocks

    def make_kv_store_link(self, **changes) -> KVStoreLink | None:
        """A link to the KV store this engine's config names, with `changes` (EngineConfig fields: another link
        trace, level or objective) applied; None without a store. Each link has its own connections, estimates
        and counters; `use_kv_store_link` puts one in use."""
        c = dataclasses.replace(self.config, **changes) if changes else self.config
        dtype = getattr(torch, c.dtype)
        if not c.kv_store:
            return None
        if not c.enable_prefix_caching:
            raise KvstrataError("kv_store needs prefix caching: chunks are found by the same chained token hashes")
        profile = shipped_profile(self.model_fingerprint)  # sets CacheGen forms' steps, when one ships
        store = make_store(c.kv_store, c.kv_store_format, dtype, self.kv_manager.namespace.decode(), self.loaded.config,
                           c.kv_store_timeout_ms / 1000, profile, c.kv_store_link_gbps,
                           probe_keys=c.prefix_loading == "impress", eviction=c.kv_store_eviction)
        mc = self.loaded.config
        layer_weights = multiplied_weights(self.loaded.model.layers)  # counted by shape: int4 weights are buffers
        prefill = PrefillSpeed.for_model(mc.num_layers, mc.num_heads, mc.head_dim, layer_weights)
        important = None if c.prefix_loading == "full" else ImportantLoading(
            c.prefix_loading, float(c.impress_ratio), c.impress_rule, c.impress_attend, self.loaded.model, self.device,
            float(c.impress_reorder_seconds))
        return KVStoreLink(store, c.kv_store_chunk_tokens, self.kv_manager, self.kv_cache, prefill, c.ttft_slo,
                           c.kv_store_level, important)

    def _make_scheduler(self) -> Scheduler:
        c = self.config
        policy = scheduling_policy(c.scheduling_policy, float(c.lpm_aging_tokens_per_s))
        if c.scheduler == "sarathi":
            return SarathiScheduler(self.kv_manager, c.max_num_seqs, c.chunk_size, c.tile, policy)
        if c.scheduler == "prefill-first":
            budget = c.max_prefill_tokens or max(self.max_model_len, 2048)
            if budget < self.max_model_len:
                raise KvstrataError(f"max_prefill_tokens {budget} is below max_model_len {self.max_model_len}")
            return PrefillFirstScheduler(self.kv_manager, c.max_num_seqs, budget, policy)
        return StaticScheduler(self.kv_manager, c.max_num_seqs, policy)

    def _tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer, with the chat template given in place of its own."""
        tokenizer = self.loaded.tokenizer
        if self.config.chat_template is None:
            return tokenizer
        if tokenizer is None:
            raise KvstrataError("a chat template was given, but this model has no tokenizer to render chats with")
        return tokenizer.with_chat_template(self.config.chat_template)

    def _sampling_defaults(self) -> dict[str, float]:
        """The model's recommended sampling settings (--generation-config auto), checked as a request's are."""
        defaults = dict(self.loaded.config.sampling_defaults) if self.config.generation_config == "auto" else {}
        try:
            SamplingParams(**defaults)
        except KvstrataError as exc:
            raise KvstrataError(f"the model's generation config recommends sampling settings that cannot be used "
                                f"({exc}); --generation-config vllm ignores them") from None
        if defaults:
            log.info("sampling settings a request leaves unset take the model's recommended values: %s", defaults)
        return defaults

    def default_sampling_params(self) -> SamplingParams:
        """A request's sampling parameters where it gives none: the model's recommended settings, else
        SamplingParams' defaults."""
        return SamplingParams(**self.sampling_defaults)

    def _eos_token_ids(self) -> set[int]:
        ids = set(self.loaded.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _compile_model(self) -> None:
        model = self.loaded.model
        if not hasattr(model, "compile_dense_parts"):
            raise KvstrataError(f"--compile supports Llama-family models, not {self.loaded.config.architecture}")
        model.compile_dense_parts()

    @property
    def model_fingerprint(self) -> str:
        """Identifies the checkpoint in files made for this model (saved contexts, profiles), whatever
        form --weights gives its weights (a profile made in one form serves the others)."""
        return self.loaded.fingerprint

    def _weights_tag(self) -> str:
        """The forms the linear layers run in: KV computed under one is not reused under another."""
        return "+".join(self.loaded.weights_summary()).replace(" ", "-")

    @property
    def model_config(self):
        return self.loaded.config

    def compute_kv(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [layers, tokens, kv_heads, head_dim] of `token_ids` (fp32, CPU): the model's forward pass
        as calibrations below the engine call it."""
        return compute_kv(self, token_ids)

    # --- requests -----------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise KvstrataError("this model has no tokenizer; give the prompt as token ids")
            return self.tokenizer.encode(prompt)
        vocab = self.loaded.config.vocab_size
        if not isinstance(prompt, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt
        ):
            raise KvstrataError(f"a token-id prompt must be a list of integers in [0, {vocab}), got {prompt!r:.200}")
        return list(prompt)

    def check_token_ids(self, param: str, tokens: Iterable[int]) -> None:
        """ParameterError naming `param` where one of the token ids it names lies outside the vocabulary."""
        vocab = self.loaded.config.vocab_size
        outside = [token for token in tokens if token >= vocab]
        if outside:
            raise ParameterError(param, f"{param} names token {outside[0]}, outside the vocabulary [0, {vocab})")

    def check_sampling(self, params: SamplingParams) -> None:
        """What only the model can tell of a request's sampling parameters: the token ids they name (bad_words' too)
        lie in the vocabulary (the sampler indexes its logits by them; a stop token outside it could never end the
        request), while min_tokens and bad_words ban tokens some token is left to generate (else a row of the
        batched sampler has no finite logit), and its structured output compiles (ParameterError
        "structured_output" otherwise; kept for add_request). A priority other than 0 needs the priority
        scheduling policy, as vLLM's does; an embedding has at most the model's hidden size of dimensions."""
        width = self.loaded.config.word_embed_proj_dim or self.loaded.config.hidden_size  # of the final states
        if params.pooling is not None and (params.pooling.dimensions or 0) > width:
            raise ParameterError("dimensions", f"dimensions {params.pooling.dimensions} exceeds this model's "
                                               f"embedding size of {width}")
        if params.priority != 0 and self.config.scheduling_policy != "priority":
            raise ParameterError("priority", f"priority {params.priority} needs the priority scheduling policy "
                                             f"(--scheduling-policy priority); this engine schedules "
                                             f"{self.config.scheduling_policy}")
        if params.structured_output is not None:
            self.grammars.check(params.structured_output)
        vocab = self.loaded.config.vocab_size
        bad_words = self._bad_word_tokens(params)
        for param, tokens in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids or []),
                              ("stop_token_ids", params.stop_token_ids),
                              ("bad_words", [token for word in bad_words for token in word])):
            self.check_token_ids(param, tokens)
        allowed = params.allowed_token_ids
        choosable = "the vocabulary" if allowed is None else "allowed_token_ids"

        def cover_choosable(banned: set[int]) -> bool:
            return len({t for t in banned if t < vocab}) >= vocab if allowed is None else set(allowed) <= banned

        ends = params.ending_tokens(self.outputs.eos_token_ids) if params.min_tokens else set()
        if cover_choosable(ends):
            raise ParameterError("min_tokens", f"min_tokens {params.min_tokens} bans every token of {choosable}: "
                                               "stop_token_ids and EOS cover all of it")
        # a bad word bans no token but its last: while those and the ends leave one, some token may be sampled
        if bad_words and cover_choosable(ends | {word[-1] for word in bad_words}):
            raise ParameterError("bad_words", f"bad_words could ban every token of {choosable} at once")

    def _bad_word_tokens(self, params: SamplingParams) -> list[tuple[int, ...]]:
        if not params.bad_words:
            return []
        if self.tokenizer is None:
            raise ParameterError("bad_words", "this model has no tokenizer to find bad_words' tokens with")
        return self._bad_word_tokens_of(tuple(params.bad_words))

    def check_prompt_length(self, token_ids: list[int], generates: bool = True) -> None:
        """A prompt that generates keeps one token of the context for its output; one that embeds may fill it."""
        if not token_ids:
            raise KvstrataError("the prompt is empty; give at least one token")
        if len(token_ids) > self.max_model_len - generates:
            raise KvstrataError(self.too_long_for_the_context(len(token_ids), generates))

    def too_long_for_the_context(self, num_tokens: int, generates: bool = True, what: str = "the prompt") -> str:
        kept = ", one token kept for the output" if generates else ""
        return (f"{what} has {num_tokens} tokens; the context allows at most {self.max_model_len - generates} "
                f"(max_model_len {self.max_model_len}{kept})")

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        preloaded: list[Preloaded] | None = None,
        cache_salt: bytes | None = None,
    ) -> str:
        """Queue a request; returns its id. `prompt` is text or a list of token ids.

        `arrival_time` (a `time.perf_counter()` reading) lets a server count queueing before this call.
        `preloaded` gives ready KV for ranges of the prompt (placed instead of prefilled); `cache_salt`
        keeps the prefix-cache blocks built on it apart from those of plain prefills (a tenant's own salt is
        `params.cache_salt`).
        """
        params = params or self.default_sampling_params()
        token_ids = self.tokenize(prompt)
        self.check_prompt_length(token_ids, generates=params.pooling is None)
        self.check_sampling(params)
        adapter = self._request_adapter(params)
        tenant = b"" if params.cache_salt is None else tenant_salt(params.cache_salt)
        store_salt = None if cache_salt is not None else tenant  # a saved context's KV is not stored below
        if tenant:
            cache_salt = (cache_salt or b"") + tenant
        if adapter is not None:  # its KV is the adapter's: its prefix-cache blocks and stored chunks are apart
            if preloaded:
                raise KvstrataError(f"KV given ready-made (a saved context) was computed without LoRA adapter "
                                    f"{adapter.name!r}; a request on it computes its whole prompt")
            cache_salt = adapter.digest + (cache_salt or b"")
            # float32 products round the KV otherwise than float64's: engines sharing a store keep them apart
            store_salt = cache_salt + self.config.lora_dtype.encode()
        if params.prompt_logprobs is not None and preloaded:
            raise KvstrataError("prompt_logprobs needs every prompt token computed; this request's preloaded KV "
                                "(a saved context) would stand in for some")
        preloaded = self._check_preloaded(preloaded or [], len(token_ids))
        self._check_preloaded_fits(preloaded, len(token_ids))
        seq_id = next(self._seq_ids)
        request_id = str(seq_id) if request_id is None else request_id
        if request_id in self._sequences:
            raise KvstrataError(f"request id {request_id!r} is already in use")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        seq = Sequence(
            seq_id=seq_id,
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=token_ids,
            params=params,
            generator=generator,
            matcher=None if params.structured_output is None else self.grammars.matcher(params.structured_output),
            bad_words=self._bad_word_tokens(params),
            preloaded=preloaded,
            cache_salt=cache_salt,
            store_salt=store_salt,
            lora=adapter,
        )
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        self._sequences[request_id] = seq
        if self.kv_store is None or not self.kv_store.begin_load(seq):
            self.scheduler.add(seq)  # else it is scheduled when its lookup below the device pool ends
        return request_id

    def _check_preloaded(self, preloaded: list[Preloaded], num_tokens: int,
                         moved: dict[int, Preloaded] | None = None) -> list[Preloaded]:
        """Ranges in order, inside the prompt, not overlapping; KV at hand must fit the model (it moves to the
        compute device and dtype now; `moved` holds the ranges already moved, by id of the range given, so that
        a range several requests share moves once); layers loaded later are checked as they are loaded."""
        mc = self.loaded.config
        dtype = getattr(torch, self.config.dtype)
        preloaded = sorted(preloaded, key=lambda s: s.start)
        position = 0
        for segment in preloaded:
            if isinstance(segment, PreloadedKV):
                shape = (mc.num_layers, segment.k.shape[1], mc.num_kv_heads, mc.head_dim)
                if tuple(segment.k.shape) != shape or tuple(segment.v.shape) != shape:
                    raise KvstrataError(f"preloaded KV of shape {tuple(segment.k.shape)} does not fit this model's "
                                        f"{shape}")
            if segment.start < position or segment.end > num_tokens:
                raise KvstrataError(
                    f"preloaded KV for tokens [{segment.start}, {segment.end}) overlaps another range or runs past "
                    f"the prompt's {num_tokens} tokens"
                )
            position = segment.end
        moved = {} if moved is None else moved
        for s in preloaded:
            if id(s) not in moved:
                moved[id(s)] = (dataclasses.replace(s, k=s.k.to(self.device, dtype), v=s.v.to(self.device, dtype))
                                if isinstance(s, PreloadedKV) else s)
        return [moved[id(s)] for s in preloaded]

    def _check_preloaded_fits(self, preloaded: list[Preloaded], num_tokens: int) -> None:
        """Preloaded KV is placed at once, up to the prompt's last token, and only then do blocks behind a sliding
        window go back: a pool sized for the window (`_tokens_a_request_holds`) may be too small for it."""
        end = min(preloaded[-1].end, num_tokens - 1) if preloaded else 0
        if self.kv_manager.blocks_needed(end) > self.kv_manager.pool.num_blocks:
            held = self.kv_manager.pool.num_blocks * self.config.block_size
            raise KvstrataError(f"this request's preloaded KV (a saved context) places {end} tokens at once; the KV "
                                f"cache holds {held}: give a larger kv_cache_memory or a shorter context")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its KV blocks; None if it is unknown or already done."""
        seq = self._sequences.pop(request_id, None)
        if seq is None:
            return None
        seq.finish_reason = "abort"
        return self._finish(seq, time.perf_counter())

    def use_kv_store_link(self, link: KVStoreLink | None) -> None:
        """Serve the next requests through `link` (from `make_kv_store_link`), or with no store; only between
        requests, since a load in flight belongs to its link. The streaming benchmark compares policies on one
        engine so: the same weights, pool and memory for every policy."""
        if self.has_unfinished_requests():
            raise KvstrataError("the KV store link can change only when no request is unfinished")
        self.kv_store = link

    def reset_prefix_cache(self) -> int:
        """Forget the prefixes the device pool caches in blocks no request holds (the KV store keeps its copies),
        so later prompts find them in the store or recompute them; the blocks forgotten."""
        return self.kv_manager.pool.forget_free()

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        """End a request with finish reason "error" and `message`; None if it is unknown or already done."""
        seq = self._sequences.get(request_id)
        return None if seq is None else self._fail(seq, message)

    def close(self) -> None:
        """Let the KV store's queued writes finish and close its connections (a server's shutdown). The engine
        takes no requests needing the store afterwards."""
        if self.kv_store is not None:
            self.kv_store.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.num_loading > 0

    @property
    def num_loading(self) -> int:
        """Requests whose KV is being fetched from the KV store, not yet scheduled."""
        return 0 if self.kv_store is None else self.kv_store.num_loading

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # --- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return the outputs of the requests that got a token or ended.

        A failure that belongs to one request (its preloaded KV cannot be stored, its logits are not finite,
        its output cannot be processed) ends that request alone with finish reason "error". A failure of the
        forward pass belongs to no one request: the step's requests end with "error", every other request
        goes on (nothing of the step was committed, so their caches are as before it).
        """
        keep_torch_threads(self.threads)  # the KV store's threads set their own: a stepping thread keeps the engine's
        if self.kv_store is not None:
            self._schedule_loaded()
        try:
            plan = self.scheduler.schedule()
        except RequestFailed as failure:  # while admitting a request; the others are scheduled next step
            return [self._fail(self._sequences[failure.request_id], str(failure))]
        if not plan.scheduled:
            if self.scheduler.has_unfinished():  # would spin forever: a scheduler bug, not user input
                raise RuntimeError(f"no tokens scheduled with {self.num_waiting} waiting, {self.num_running} running")
            return []
        start = time.perf_counter()
        try:
            result = self.runner.execute(plan.scheduled)
        except Exception as exc:
            log.exception("a step's forward pass failed; ending the %d requests in it", len(plan.scheduled))
            return [self._fail(seq, f"internal engine error: {type(exc).__name__}: {exc}") for seq, _ in plan.scheduled]
        outputs = []
        prefill_tokens, prefill_work = 0, PrefillWork()
        for seq, num_tokens in plan.scheduled:
            verifying = verifies(seq, num_tokens)  # its last token and its drafts
            is_decode = (num_tokens == 1 or verifying) and seq.num_computed_tokens >= seq.num_prompt_tokens
            if not is_decode:
                prefill_tokens += num_tokens
                prefill_work += PrefillWork.span(seq.num_computed_tokens, num_tokens)
            computed = 1 if verifying else num_tokens  # a draft's KV counts once it is accepted
            seq.num_computed_tokens += computed
            self.kv_manager.commit(seq, computed)
            if self.kv_store is not None and not is_decode and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self.kv_store.store_prompt(seq, max(seq.num_cached_prompt_tokens or 0, seq.num_store_tokens))
                if seq.num_store_tokens:
                    seq.preloaded = []  # placed: free the host copy (after a preemption the prompt is prefilled)
            if self.kv_store is None or seq.num_computed_tokens >= seq.num_prompt_tokens:  # the store reads it whole
                self.kv_manager.release_behind_window(seq)
            outputs.extend(self._place_preloaded(seq))
        outputs.extend(self._record_prompt_logprobs(result.prompt_rows))
        outputs.extend(self._pool(result.pooled))
        to_sample, logits, failed = self._drop_ended_and_nonfinite(result.to_sample, result.logits)
        outputs.extend(failed)
        to_sample, logits, constraints, failed = self._constraints(to_sample, logits)
        outputs.extend(failed)
        histories = Histories(draft_histories(to_sample), [s.num_prompt_tokens for s in to_sample],
                              self.outputs.eos_token_ids, [s.bad_words for s in to_sample])
        tokens, logprobs = sample(logits, [s.params for s in to_sample], [s.generator for s in to_sample], histories,
                                  constraints)
        now = time.perf_counter()
        if self.kv_store is not None:
            self.kv_store.observe_prefill(prefill_work, now - start)
        num_drafts = num_accepted = 0
        rejected_slots = []
        for seq, first, end in sequence_rows(to_sample):
            accepted = accepted_tokens(seq.draft_token_ids, tokens[first:end])
            num_drafts, num_accepted = num_drafts + len(seq.draft_token_ids), num_accepted + len(accepted) - 1
            rejected = rejected_draft_positions(seq, len(accepted)) if self.kv_cache.keeps_discarded_tokens else ()
            if rejected:
                rejected_slots += token_slots(np.asarray([seq.block_table]), 0, np.asarray(rejected),
                                              self.config.block_size).tolist()
            seq.draft_token_ids = []
            outputs.append(self._append_tokens(seq, accepted, logprobs[first : first + len(accepted)], now))
        if rejected_slots:
            self.kv_cache.discard_tokens(torch.tensor(rejected_slots, device=self.kv_cache.device))
        self.step_stats.append(
            StepStats(prefill_tokens, plan.num_tokens - prefill_tokens, len(plan.scheduled), len(plan.preempted),
                      now - start, num_drafts, num_accepted)
        )
        return outputs

    def _drafts_for(self, seq: Sequence) -> list[int]:
        """Tokens guessed to follow `seq`'s last one, for its decode step to verify: none while the running batch is
        at the size from which drafting is off, where it has a structured output (its grammar matcher takes tokens one
        at a time), where it samples with a seed (a row after a rejected draft would draw from its generator too, so
        the seed would give other tokens than without drafts) or where nothing could follow them (its max_tokens or
        the context would end it first)."""
        batch_limit = self.config.speculative_disable_by_batch_size
        if batch_limit is not None and len(self.scheduler.running) >= batch_limit:
            return []
        if seq.matcher is not None or (seq.generator is not None and not seq.params.greedy):
            return []
        limit = min(seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens)
        return self.proposer.propose(seq.seq_id, seq.token_ids, limit)

    def _schedule_loaded(self) -> None:
        """Requests whose lookup below the device pool ended join the scheduler, with the KV it found. With
        nothing else to run, wait a little for one rather than spin."""
        moved: dict[int, Preloaded] = {}  # ranges that loads share (requests with one prompt or prefix): moved once
        for seq, ranges in self.kv_store.take_ready(timeout=0.0 if self.scheduler.has_unfinished() else 0.05):
            try:
                if ranges:
                    seq.preloaded = self._check_preloaded(ranges, seq.num_tokens, moved)
                    seq.num_store_tokens = ranges[-1].end
            except Exception:  # it does not fit, or the device is short of memory: prefill instead
                log.exception("request %s: KV from the store could not be taken; it is prefilled", seq.request_id)
                seq.preloaded, seq.num_store_tokens = [], 0
            self.scheduler.add(seq)

    def _place_preloaded(self, seq: Sequence) -> list[RequestOutput]:
        """Store the preloaded range that follows the step's tokens; a failure ends `seq` alone."""
        if not seq.preloaded:
            return []
        placed_before = seq.num_preloaded_tokens
        try:
            if not self.kv_manager.place_preloaded(seq):
                self.scheduler.preempt(seq)  # short of blocks for its next preloaded range
        except RequestFailed as failure:
            return [self._fail(seq, str(failure))]
        if not seq.num_preemptions and seq.num_reused_prompt_tokens is not None:  # reused once, not on a re-prefill
            seq.num_reused_prompt_tokens += seq.num_preloaded_tokens - placed_before
        return []

    def _record_prompt_logprobs(self, prompt_rows: list[PromptRows]) -> list[RequestOutput]:
        """The logprobs of the prompt tokens this step computed, for the requests asking; a failure ends that
        request alone (after its step was committed: its blocks are sound)."""
        failed = []
        for rows in prompt_rows:
            try:
                self.runner.record_prompt_logprobs(rows)
            except Exception as exc:
                log.exception("request %s: its prompt's logprobs could not be computed", rows.seq.request_id)
                failed.append(self._fail(rows.seq, f"its prompt's logprobs could not be computed: "
                                                   f"{type(exc).__name__}: {exc}"))
        return failed

    def _pool(self, pooled: list[tuple[Sequence, torch.Tensor]]) -> list[RequestOutput]:
        """End each pooling request whose prompt the step completed, with its embedding (after the step's commit:
        its prompt's blocks stay cached for others); a failure ends that request alone, and one that is not finite
        keeps its blocks from other requests (its context may be corrupt, as with logits that are not)."""
        outputs = []
        for seq, hidden in pooled:
            if seq.finish_reason is not None:  # ended earlier in the step
                continue
            try:
                seq.embedding = seq.params.pooling.embedding(hidden)
            except Exception as exc:
                log.exception("request %s: its embedding could not be made", seq.request_id)
                outputs.append(self._fail(seq, f"its embedding could not be made: {type(exc).__name__}: {exc}"))
                continue
            if seq.embedding is None:
                outputs.append(self._fail(seq, "its embedding is not finite", corrupt_cache=True))
                continue
            now = time.perf_counter()
            seq.first_token_time = now  # what the request asked for is here: time to first token ends
            seq.finish_reason = "stop"
            self._sequences.pop(seq.request_id, None)
            outputs.append(self._finish(seq, now))
        return outputs

    def _drop_ended_and_nonfinite(self, to_sample: list[Sequence], logits: torch.Tensor):
        """Sequences with a row of logits holding NaN or inf (a corrupt context) end with an error; those that ended
        earlier in the step are dropped; the rest are sampled."""
        broken = {id(seq): seq for seq, ok in zip(to_sample, finite_rows(logits)) if not ok}
        keep = [id(seq) not in broken and seq.finish_reason is None for seq in to_sample]
        if all(keep):
            return to_sample, logits, []
        failed = [self._fail(seq, "the model's logits for this request are not finite (NaN or inf): its context "
                                  "(a preloaded KV cache, most likely) is corrupt", corrupt_cache=True)
                  for seq in broken.values() if seq.finish_reason is None]
        return [seq for seq, ok in zip(to_sample, keep) if ok], logits[torch.tensor(keep, device=logits.device)], failed

    def _constraints(self, to_sample: list[Sequence], logits: torch.Tensor):
        """The tokens each sequence's structured output allows next (None where it has none). A sequence whose
        constraint cannot go on (it needs a byte no token holds, or a parser limit was reached) ends with an error
        and is dropped."""
        constraints, failed, keep = [], [], []
        for seq in to_sample:
            allowed = None if seq.matcher is None else allowed_tokens(seq.matcher, logits.shape[-1])
            if allowed is not None and (seq.matcher.is_error() or not allowed.any()):
                failed.append(self._fail(seq, f"its structured output cannot go on: {matcher_error(seq.matcher)}",
                                         caused_by_input=True))
            constraints.append(None if allowed is None else torch.from_numpy(allowed).to(logits.device))
            keep.append(seq.finish_reason is None)
        if all(keep):
            return to_sample, logits, constraints, []
        rows = [row for row, kept in enumerate(keep) if kept]
        return ([to_sample[row] for row in rows], logits[rows], [constraints[row] for row in rows], failed)

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list, now: float) -> RequestOutput:
        """Append the step's tokens to `seq`: its sampled one, or its accepted drafts and the token sampled after
        them (each draft's KV is computed: it counts once the draft is in the sequence), until one ends it."""
        after_load = (seq.store_load_end, seq.store_plan, seq.store_last_plan)
        if any(told is not None for told in after_load):  # its first token after a store load
            self.kv_store.observe_first_token(seq, now)
        for i, (token, token_logprobs) in enumerate(zip(tokens, logprobs)):
            if i:  # the token before was an accepted draft, and nothing ended the sequence there
                seq.num_computed_tokens += 1
                self.kv_manager.commit(seq, 1)
            # the token was allowed, yet consuming it may reach one of the parser's limits
            if seq.matcher is not None and not seq.matcher.consume_token(token):
                return self._fail(seq, f"its structured output cannot go on: {matcher_error(seq.matcher)}",
                                  caused_by_input=True)
            try:
                self.outputs.append_token(seq, token, token_logprobs, now)
            except Exception as exc:  # detokenizing or matching stop strings: a fault of this request's output only
                log.exception("request %s: its output could not be processed", seq.request_id)
                return self._fail(seq, f"its output could not be processed: {type(exc).__name__}: {exc}")
            if seq.finish_reason is not None:
                break
        if seq.finish_reason is not None:
            self._sequences.pop(seq.request_id, None)
            return self._finish(seq, now)
        return self.outputs.build_output(seq)

    def _fail(self, seq: Sequence, message: str, corrupt_cache: bool = False,
              caused_by_input: bool = False) -> RequestOutput:
        """End `seq` with finish reason "error". With `corrupt_cache`, the blocks it wrote are never served to
        another request (otherwise its committed blocks are sound and stay in the prefix cache);
        `caused_by_input`: what the request asked is the cause, not a fault of the engine or its data."""
        self._sequences.pop(seq.request_id, None)
        seq.finish_reason, seq.error, seq.error_caused_by_input = "error", message, caused_by_input
        if corrupt_cache:
            self.kv_manager.discard(seq)
        return self._finish(seq, time.perf_counter())

    def _finish(self, seq: Sequence, now: float) -> RequestOutput:
        ended_well = seq.finish_reason in ("stop", "length")
        tail_kv = self._tail_kv(seq) if seq.params.keep_tail_kv and ended_well else None  # before its blocks go
        self.scheduler.finish(seq)
        if self.proposer is not None:
            self.proposer.forget(seq.seq_id)
        if self.kv_store is not None:
            self.kv_store.forget(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_time = now
        output = self.outputs.build_output(seq)
        output.tail_kv = tail_kv
        return output

    @functools.cached_property
    def _tails_handed_over(self) -> bool:
        """Whether a request's tail KV can be handed to another as it is: with prefix caching (else the other computes
        its context anyway), where every cached token is live and loaded (not under H2O or InfiniGen, which evict
        tokens, nor IMPRESS's loads, which leave some unloaded), and where storing it again stores the same values
        (not Oaken's records, nor a format's decoded values cast to a narrower compute dtype)."""
        c = self.config
        return (c.enable_prefix_caching and c.kv_offload in ("none", "full") and c.prefix_loading == "full"
                and self.kv_cache.restores_exactly(getattr(torch, c.dtype)))

    def _tail_kv(self, seq: Sequence) -> PreloadedKV | None:
        """The KV of `seq`'s computed tokens after its last full block, decoded, in the engine's dtype, for a request
        that continues them; None where they fill whole blocks or cannot be handed over as they are (a request
        continuing them then computes them)."""
        end = seq.num_computed_tokens
        start = end - end % self.config.block_size
        if start == end or not seq.computes_plain_kv or not self._tails_handed_over:
            # KV built on a saved context must not reach blocks a plain prefill would have built, and a request on
            # an adapter takes no KV ready-made (add_request): its beams compute their last block
            return None
        dtype = getattr(torch, self.config.dtype)
        k, v = self.kv_cache.read_layers(seq.block_table, end, start)
        return PreloadedKV(start, k.to(dtype), v.to(dtype))
