"""Beam search: the likeliest continuations of a prompt, found as Hugging Face transformers' `generate(num_beams=k)`
finds them (its ranking, length penalty and stopping rules), on top of the engine's requests. Where two
continuations score exactly the same, the one of the earlier beam, then the lower token, ranks first; transformers'
`topk` leaves such ties in no stated order, so beams may part there.

A search runs in rounds. Each round scores the next token of every running beam with one request of one token
per beam, whose prompt is the beam's tokens (vLLM's way). A beam's KV is its parent's: the prefix cache finds every
full block of the parent, and the parent's request handed back the KV of its tokens after them
(`SamplingParams.keep_tail_kv`), which the beam's request is given as preloaded KV; so a round computes one token
a beam, the beam's newest. Where that KV would not be what computing gives (LLMEngine._tails_handed_over: Oaken's
records, a narrower compute dtype, policies that evict or skip tokens), the beam's request computes those tokens
(at most a block); without prefix caching (H2O, --no-prefix-caching) it computes the beam's whole context. A
search in flight holds no blocks between rounds, so under memory pressure a round may find less cached and compute
more; its result is the same.

Of each beam, a round needs only its `beam_width + (tokens that end a beam)` likeliest next tokens: transformers
keeps the best max(2, 1 + end tokens) x beam_width continuations of all beams, continues the best `beam_width` of
them that end nothing, and finishes those that end among the best `beam_width`. A beam's continuation ranked below
that many of its own can be neither: at least `beam_width` of its siblings that end nothing rank above it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from kvstrata.engine.detokenizer import IncrementalDetokenizer
from kvstrata.engine.outputs import RequestOutput
from kvstrata.engine.sampling_params import MAX_LOGPROBS, SamplingParams, check_cache_salt, check_priority
from kvstrata.errors import ParameterError
from kvstrata.kv.preloaded import PreloadedKV

EARLY_STOPPING = (False, True, "never")
# length ** length_penalty stays well inside float32 up to this for any context (131,072 ** 5 is 2 ** 85, and
# float32 reaches 2 ** 128)
MAX_LENGTH_PENALTY = 5.0


@dataclass(frozen=True)
class BeamSearchParams:
    """`early_stopping` as transformers takes it: True ends the search once `beam_width` beams finished; False
    (its default) also once no running beam can still beat the finished ones at its present length; "never" only
    once none could at `max_tokens` either (with a positive length penalty; at the present length otherwise)."""

    beam_width: int
    max_tokens: int = 16
    num_returned: int | None = None  # the best this many finished beams are returned; None: `beam_width`
    # a finished beam ranks by its log-likelihood over (its output tokens ** length_penalty): above 0 favours
    # longer outputs, below 0 shorter ones
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False  # the model's end tokens end no beam (stop_token_ids still do)
    stop_token_ids: tuple[int, ...] = ()  # these end a beam too
    skip_special_tokens: bool = True  # the returned texts leave special tokens out
    lora_name: str | None = None  # the LoRA adapter the beams are scored on (SamplingParams.lora_name)
    priority: int = 0  # its rounds' requests' (SamplingParams.priority)
    cache_salt: str | None = None  # its rounds' requests' (SamplingParams.cache_salt)

    def __post_init__(self) -> None:
        for name, value, least in (("beam_width", self.beam_width, 1), ("max_tokens", self.max_tokens, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ParameterError(name, f"{name} must be an integer >= {least}, got {value!r}")
        returned = self.num_returned
        if returned is not None and (isinstance(returned, bool) or not isinstance(returned, int)
                                     or not 1 <= returned <= self.beam_width):
            raise ParameterError("num_returned", f"num_returned must be an integer from 1 to beam_width "
                                                 f"{self.beam_width}, got {returned!r}")
        penalty = self.length_penalty
        if (isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty)
                or abs(penalty) > MAX_LENGTH_PENALTY):
            raise ParameterError("length_penalty", f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY}, "
                                                   f"{MAX_LENGTH_PENALTY}], got {penalty!r}")
        if not any(self.early_stopping is allowed or self.early_stopping == allowed == "never"
                   for allowed in EARLY_STOPPING):
            raise ParameterError("early_stopping", f"early_stopping must be true, false or \"never\", got "
                                                   f"{self.early_stopping!r}")
        check_priority(self.priority)
        check_cache_salt(self.cache_salt)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ParameterError("stop_token_ids", f"stop_token_ids must be token ids, got {self.stop_token_ids!r}")

    @property
    def returned(self) -> int:
        return self.beam_width if self.num_returned is None else self.num_returned


# Sampling settings beam search does not follow (the server's and the CLI's names), and their values that ask
# nothing of it besides null and false: temperature 1 is the model's own distribution, which beams are ranked by,
# and 0 asks for determinism, which beam search has.
SAMPLING_SETTINGS_NEUTRAL = {
    "temperature": (0, 1), "top_p": (1,), "top_k": (0, -1), "min_p": (0,), "repetition_penalty": (1,),
    "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},), "allowed_token_ids": (),
    "bad_words": ([],), "min_tokens": (0,), "stop": ([],), "logprobs": (), "top_logprobs": (0,),
    "prompt_logprobs": (),
}


def refuse_sampling_settings(settings, beam_search: str) -> None:
    """ParameterError naming the first sampling setting of `settings` (an object with some of those names as
    attributes) that asks for something beam search would not do; `beam_search`: what asked for beam search."""
    for name, neutral in SAMPLING_SETTINGS_NEUTRAL.items():
        value = getattr(settings, name, None)
        if not (value is None or value is False or value in neutral):
            raise ParameterError(name, f"{name} {value!r} cannot be combined with {beam_search}: beam search "
                                       "samples nothing; it ranks continuations by the model's likelihood")


@dataclass(frozen=True)
class BeamSequence:
    """A finished beam."""

    token_ids: tuple[int, ...]  # output tokens, the end token included where one ended it
    cumulative_logprob: float
    score: float  # what beams rank by: cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (an end token) or "length"


@dataclass
class BeamSearchOutput:
    """A prompt's best finished beams, best first, with their texts; none, and `error` saying why, where a request
    of its search failed."""

    prompt_token_ids: list[int]
    sequences: list[BeamSequence]
    texts: list[str]
    error: str | None = None


@dataclass(frozen=True)
class _Beam:
    token_ids: tuple[int, ...]
    logprob: np.float32  # cumulative, in float32 as transformers sums it (its ties and rounding)
    tail_kv: PreloadedKV | None = None  # its parent's KV after the parent's last full block


@dataclass(frozen=True)
class RoundRequest:
    """A running beam's request in a round: its tokens, and the KV that its parent's request left after the last
    full block (the prefix cache holds the blocks before)."""

    token_ids: list[int]
    preloaded: list[PreloadedKV]


class BeamSearch:
    """One prompt's search. Call `round_requests` and `round_params` for the requests of a round, then `advance`
    with their outputs, until `done`; `best` then holds the result."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: Collection[int]):
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.end_token_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                                 else frozenset(eos_token_ids))
        if self.alternatives > MAX_LOGPROBS:
            raise ParameterError("beam_width", f"beam_width {params.beam_width} with {len(self.end_token_ids)} "
                                               f"tokens that end a beam needs each beam's {self.alternatives} "
                                               f"likeliest next tokens; the engine reports at most {MAX_LOGPROBS}")
        self.running = [_Beam((), np.float32(0))]
        self.finished: list[BeamSequence] = []  # at most beam_width, best first
        self.improvable = True  # whether a running beam may still beat the worst finished one
        self.error: str | None = None  # why it stopped, where a request of a round failed
        self.num_cached_prompt_tokens = 0  # prompt tokens the first round found cached
        self.first_round_end: float | None = None  # when the first output tokens were known (perf_counter)

    @property
    def alternatives(self) -> int:
        """How many of each running beam's likeliest next tokens a round needs (the module's docstring says why)."""
        return self.params.beam_width + len(self.end_token_ids)

    @property
    def done(self) -> bool:
        if self.error is not None:
            return True
        full = len(self.finished) == self.params.beam_width
        return not self.running or not self.improvable or (full and self.params.early_stopping is True)

    @property
    def best(self) -> list[BeamSequence]:
        return self.finished[: self.params.returned]

    def round_requests(self) -> list[RoundRequest]:
        return [RoundRequest(self.prompt_token_ids + list(beam.token_ids), [beam.tail_kv] if beam.tail_kv else [])
                for beam in self.running]

    def round_params(self) -> SamplingParams:
        # greedy and ignoring EOS: the token the request draws is not used, only its alternatives' logprobs; the
        # KV after its last full block comes back for its children's requests
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=self.alternatives, ignore_eos=True,
                              keep_tail_kv=True, lora_name=self.params.lora_name, priority=self.params.priority,
                              cache_salt=self.params.cache_salt)

    def advance(self, outputs: list[RequestOutput], now: float) -> None:
        """Take a round's outputs (one per running beam, in `round_requests`' order), while the search is not `done`:
        finish the beams that end among the best continuations, and keep the best `beam_width` that end nothing
        running."""
        if self.first_round_end is None:
            self.first_round_end = now
            self.num_cached_prompt_tokens = outputs[0].num_cached_tokens
        width, penalty = self.params.beam_width, self.params.length_penalty
        length = len(self.running[0].token_ids) + 1
        at_limit = length >= self.params.max_tokens
        candidates = sorted(
            ((np.float32(beam.logprob + np.float32(logprob)), index, token)
             for index, (beam, output) in enumerate(zip(self.running, outputs))
             for token, logprob in output.logprobs[0].top.items()),
            key=lambda candidate: (-candidate[0], candidate[1], candidate[2]))

        def ends(token: int) -> bool:
            return at_limit or token in self.end_token_ids

        scale = np.float32(length**penalty)
        new = [BeamSequence(self.running[index].token_ids + (token,), float(logprob), float(logprob / scale),
                            "length" if token not in self.end_token_ids else "stop")
               for logprob, index, token in candidates[:width] if ends(token)]
        self.finished = sorted(self.finished + new, key=lambda beam: -beam.score)[:width]
        self.running = [_Beam(self.running[index].token_ids + (token,), logprob, outputs[index].tail_kv)
                        for logprob, index, token in candidates if not ends(token)][:width]
        if self.running and len(self.finished) == width:
            horizon = self.params.max_tokens if self.params.early_stopping == "never" and penalty > 0 else length
            best_possible = self.running[0].logprob / np.float32(horizon**penalty)
            self.improvable = bool(best_possible > min(beam.score for beam in self.finished))

    def output(self, tokenizer) -> BeamSearchOutput:
        """The result, with the texts of its beams as the engine's outputs show texts (an end token left out)."""
        if self.error is not None:
            return BeamSearchOutput(self.prompt_token_ids, [], [], self.error)
        texts = []
        for beam in self.best:
            tokens = beam.token_ids[:-1] if beam.finish_reason == "stop" else beam.token_ids
            texts.append("" if tokenizer is None else beam_text(tokenizer, self.prompt_token_ids, tokens,
                                                                self.params.skip_special_tokens))
        return BeamSearchOutput(self.prompt_token_ids, self.best, texts)


def beam_text(tokenizer, prompt_token_ids: list[int], token_ids: tuple[int, ...], skip_special_tokens: bool) -> str:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    return "".join(detokenizer.add(token) for token in token_ids) + detokenizer.flush()


def new_searches(engine, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearch]:
    """A search per prompt (token ids) on `engine` (an LLMEngine), the prompt's length and room and the stop token
    ids checked."""
    engine.check_token_ids("stop_token_ids", params.stop_token_ids)
    searches = []
    for token_ids in prompts:
        engine.check_prompt_length(token_ids)
        if len(token_ids) + params.max_tokens > engine.max_model_len:
            raise ParameterError("max_tokens", f"max_tokens {params.max_tokens} does not fit the context: the prompt "
                                               f"has {len(token_ids)} tokens of max_model_len {engine.max_model_len}")
        searches.append(BeamSearch(token_ids, params, engine.outputs.eos_token_ids))
    return searches


def run_searches(engine, searches: list[BeamSearch]) -> None:
    """Drive every search to its end on `engine` (an LLMEngine that nothing else steps meanwhile). A search's next
    round starts as soon as its last one ended, so searches do not wait for one another; one whose request fails
    stops there, with `error` set, and the others go on. Should this raise (or be interrupted), the rounds' requests
    still in the engine are aborted."""
    rounds: dict[str, tuple[BeamSearch, int]] = {}  # a round's request id -> its search, its beam's place
    answers: dict[int, list[RequestOutput | None]] = {}  # by id of the search: its round's outputs so far

    def start(search: BeamSearch) -> None:
        requests, params = search.round_requests(), search.round_params()
        answers[id(search)] = [None] * len(requests)
        for place, request in enumerate(requests):
            request_id = engine.add_request(request.token_ids, params, preloaded=request.preloaded)
            rounds[request_id] = (search, place)

    def abort(ids: list[str]) -> None:
        for request_id in ids:
            del rounds[request_id]
            engine.abort(request_id)

    try:
        for search in searches:
            start(search)
        while rounds:
            for output in engine.step():
                if not output.finished or output.request_id not in rounds:
                    continue
                search, place = rounds.pop(output.request_id)
                if output.finish_reason == "error":
                    search.error = output.error
                    abort([request_id for request_id, (other, _) in rounds.items() if other is search])
                    continue
                answer = answers[id(search)]
                answer[place] = output
                if all(answer):
                    search.advance(answer, time.perf_counter())
                    if not search.done:
                        start(search)
    finally:
        abort(list(rounds))
