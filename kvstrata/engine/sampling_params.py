"""What a request asks of generation; every field is checked when the object is built."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.engine.pooling_params import PoolingParams
from kvstrata.engine.structured_output import StructuredOutput
from kvstrata.errors import KvstrataError, ParameterError

MAX_LOGPROBS = 20
MAX_BAD_WORDS = 1024  # each is looked for after every token: a bound on the step's work
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds
# Below this a temperature samples greedily, its limit (vLLM draws the same line): fp32 logits divided by
# 1e-40 overflow to inf, and the softmax of inf is NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 all but bans a token, 100 all but forces it
MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties: -2 to 2
# Logits divided or multiplied by a repetition penalty in this range stay finite (a softmax of inf is NaN).
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def _check_int(name: str, value, minimum: int, allow_none: bool = False, maximum: int | None = None) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise KvstrataError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise KvstrataError(f"{name} must be at most {maximum}, got {value!r}")


def _check_number(name: str, value, low: float, high: float, low_inclusive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KvstrataError(f"{name} must be a number, got {value!r}")
    above_low = value >= low if low_inclusive else value > low
    if not (above_low and value <= high):
        bracket = "[" if low_inclusive else "("
        raise KvstrataError(f"{name} must be in {bracket}{low}, {high}], got {value!r}")


def check_priority(priority) -> None:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ParameterError("priority", f"priority must be an integer (lower runs earlier), got {priority!r:.200}")


def check_cache_salt(cache_salt) -> None:
    if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
        raise ParameterError("cache_salt", f"cache_salt must be a non-empty string, got {cache_salt!r:.200}")


@dataclass
class SamplingParams:
    """temperature 0 (or below GREEDY_BELOW_TEMPERATURE) means greedy; top_k 0, top_p 1, min_p 0, the penalties'
    0 and repetition_penalty 1 switch those off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives to report per token, besides the chosen one
    # the same for each prompt token after the first (each is then computed: no prefix-cache hit, no stored KV)
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit before sampling
    min_tokens: int = 0  # output tokens before an EOS, a stop token or a stop string may end the output
    min_p: float = 0.0  # after temperature, tokens less likely than min_p x the likeliest one are dropped
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds (OpenAI's)
    frequency_penalty: float = 0.0  # subtracted from a token's logit once per time the output holds it (OpenAI's)
    # a token the prompt or the output holds: its logit divided by this where positive, multiplied where not
    repetition_penalty: float = 1.0
    allowed_token_ids: list[int] | None = None  # only these may be generated; None: any
    # words the output may not hold (vLLM's): the token that would complete one is banned, at the text's start
    # and after a space alike
    bad_words: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # a stop string that ends the output stays in its text
    skip_special_tokens: bool = True  # the output text leaves special tokens out
    # the output held to a JSON schema, a regex, a list of choices or a grammar; it ends when that is complete
    structured_output: StructuredOutput | None = None
    # the output carries the KV of the request's tokens after its last full block (RequestOutput.tail_kv), which the
    # prefix cache does not keep: a request continuing those tokens takes it as preloaded KV (beam search's rounds);
    # none where it cannot be handed over as it is (LLMEngine._tails_handed_over)
    keep_tail_kv: bool = False
    # the LoRA adapter (loaded in the engine under this name) the request runs with; None: the base model. vLLM
    # passes a LoRARequest beside the parameters, as LLM.generate's lora_request does here
    lora_name: str | None = None
    # its place in the queues under the engine's priority scheduling: lower runs earlier, and may preempt running
    # requests of a larger number (vLLM passes it beside the parameters, as LLM.generate's priority does here)
    priority: int = 0
    # vLLM's cache_salt: the request reuses cached KV (the prefix cache's, the KV store's) only from requests that
    # gave the same string, and its own is reused only by those (kv/block_hash.py tenant_salt); None: shared by all
    cache_salt: str | None = None
    # the request embeds its prompt instead of generating (LLM.embed, /v1/embeddings; vLLM passes PoolingParams in
    # place of SamplingParams): its output carries the embedding, and nothing else here applies
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1)
        _check_number("temperature", self.temperature, 0.0, float("inf"), low_inclusive=True)
        _check_number("top_p", self.top_p, 0.0, 1.0, low_inclusive=False)
        _check_int("top_k", self.top_k, 0)
        _check_int("seed", self.seed, 0, allow_none=True, maximum=MAX_SEED)
        _check_int("logprobs", self.logprobs, 0, allow_none=True, maximum=MAX_LOGPROBS)
        _check_int("prompt_logprobs", self.prompt_logprobs, 0, allow_none=True, maximum=MAX_LOGPROBS)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise KvstrataError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list):
            raise KvstrataError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids entry", token, 0)
        if not isinstance(self.logit_bias, dict):
            raise KvstrataError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r:.200}")
        for token, bias in self.logit_bias.items():
            _check_int("a logit_bias token id", token, 0)
            _check_number(f"logit_bias of token {token}", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, low_inclusive=True)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise KvstrataError(f"allowed_token_ids must be a non-empty list of token ids, got "
                                    f"{self.allowed_token_ids!r:.200}")
            for token in self.allowed_token_ids:
                _check_int("allowed_token_ids entry", token, 0)
        if not (isinstance(self.bad_words, list) and all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise ParameterError("bad_words", f"bad_words must be a list of words (strings not blank), got "
                                              f"{self.bad_words!r:.200}")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ParameterError("bad_words", f"bad_words has {len(self.bad_words)} words; at most {MAX_BAD_WORDS}")
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise KvstrataError(f"min_tokens {self.min_tokens} exceeds max_tokens {self.max_tokens}")
        _check_number("min_p", self.min_p, 0.0, 1.0, low_inclusive=True)
        _check_number("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY, low_inclusive=True)
        _check_number("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY, low_inclusive=True)
        _check_number("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE, low_inclusive=True)
        if self.lora_name is not None and not (isinstance(self.lora_name, str) and self.lora_name):
            raise KvstrataError(f"lora_name must be a LoRA adapter's name (a non-empty string), got "
                                f"{self.lora_name!r:.200}")
        check_priority(self.priority)
        check_cache_salt(self.cache_salt)
        if self.pooling is not None and not isinstance(self.pooling, PoolingParams):
            raise KvstrataError(f"pooling must be a PoolingParams, got {self.pooling!r:.200}")
        if self.pooling is not None and (self.prompt_logprobs is not None or self.structured_output is not None):
            raise KvstrataError("a request that embeds its prompt generates nothing: prompt_logprobs and "
                                "structured_output do not apply")
        self._check_structured_output()

    def _check_structured_output(self) -> None:
        if self.structured_output is None:
            return
        if not isinstance(self.structured_output, StructuredOutput):
            raise KvstrataError(f"structured_output must be a StructuredOutput, got {self.structured_output!r:.200}")
        # Any of these could leave a step with no token both it and the constraint allow (the constraint may allow
        # only the end of the output while min_tokens bans it).
        if self.min_tokens:
            raise ParameterError("min_tokens", "min_tokens cannot be combined with structured output: the "
                                               "constraint decides where the output may end")
        if self.allowed_token_ids is not None:
            raise ParameterError("allowed_token_ids", "allowed_token_ids cannot be combined with structured output: "
                                                      "the constraint decides which tokens are allowed")
        if self.bad_words:
            raise ParameterError("bad_words", "bad_words cannot be combined with structured output: the constraint "
                                              "decides which tokens are allowed")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    def ending_tokens(self, eos_token_ids: set[int]) -> set[int]:
        """The tokens that end the output: its stop tokens, and the model's EOS unless it is ignored."""
        return set(self.stop_token_ids) | (set() if self.ignore_eos else eos_token_ids)

    @property
    def penalizes(self) -> bool:
        """Whether tokens the sequence already holds are penalized."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads the tokens the sequence holds: penalties, min_tokens, bad words."""
        return self.penalizes or self.min_tokens > 0 or bool(self.bad_words)
