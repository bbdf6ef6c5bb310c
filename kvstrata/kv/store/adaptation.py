"""Which level each chunk of a streamed context is loaded at, or whether its tokens are recomputed from text
(CacheGen §4, Algorithm 1; papers/cachegen.md §3), with an explicit quality order: text (lossless), then the
stored levels best first.

For the next chunk, an option's cost is what loading every remaining chunk that way would take, at the
throughput the last chunk read got (assumed to hold). Reading and decoding work side by side (chunks already
read are decoded, by as many decoders as the link has, while the next one is read), so the load is simulated
chunk by chunk (plan_seconds); text costs its tokens' prefill, after the load, at their place in the context
(prefill_speed.py). The best option whose cost, with the tokens recomputed anyway, fits in the time left
before the objective is chosen; if none fits, the quickest, looking one chunk ahead (quickest_option: chosen
again at every chunk, this mixes levels). Before any throughput is known, a level is DEFAULT_LEVEL.

The estimates err (decoding shares the cores with the reads and the engine, reads jitter), and a plan that
uses every second it believes it has lands just past the objective. So each load's first plan is checked
against the time its first token actually took (planned_seconds), and costs are stretched by the worst of
the recent loads' ratios (LinkEstimate.plan_factor): the margin is what this machine's estimates have been
missing by. That margin shrinks with the time left, while what follows a load's last choice (the last
decodes, the prefill of the tokens after the load, the step that samples) jitters by seconds that do not:
so each load's last choice, stretched, is checked too, and the worst recent overshoot is kept back from the
time left (LinkEstimate.reserve_seconds). After each read, a chunk sent below what that read's throughput
allowed is told (below_allowed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstrata.cachegen.levels import CACHEGEN_LEVELS
from kvstrata.kv.store.forms import STREAMED_LEVELS
from kvstrata.kv.store.prefill_speed import PrefillSpeed, PrefillWork

TEXT = "text"
QUALITY_ORDER = (TEXT, *STREAMED_LEVELS)  # best first
DEFAULT_LEVEL = "medium"  # the paper's choice for a first chunk when nothing is known of the link
PLAN_ERRORS_KEPT = 8  # recent loads whose plan error (actual / predicted seconds) the next plans allow for
FIRST_PLAN_FACTOR = 1 / 0.9  # before any load was checked: 10% of the time left kept free


@dataclass
class LinkEstimate:
    bytes_per_second: float | None = None  # what the last chunk read got
    decode_seconds: dict[str, float] = field(default_factory=dict)  # per chunk, by level (observe_decode)
    prefill: PrefillSpeed = field(default_factory=PrefillSpeed)  # the engine's recent prefill speed
    after_load_seconds: float = 0.0  # from a load's end to the first token, prefill aside (placing the KV, ...)
    plan_errors: tuple[float, ...] = ()  # of recent loads: actual / predicted seconds from the first choice on
    overshoots: tuple[float, ...] = ()  # of recent loads: seconds past the stretched plan of the last choice
    decoders: int = 1  # chunks decoded side by side (decode_seconds is what one takes with the others busy)

    def observe_decode(self, level: str, seconds: float) -> None:
        """A chunk at `level` took `seconds` to decode. Averaged with the earlier ones, half and half: one chunk's
        time moves with what the other decoder and the reads do meanwhile, and a level that looked quicker by
        that noise alone would be chosen over one that is not."""
        previous = self.decode_seconds.get(level)
        average = seconds if previous is None else 0.5 * (previous + seconds)
        # a new dict each time: decoder threads write it while the load thread reads it
        self.decode_seconds = {**self.decode_seconds, level: average}

    def observe_plan(self, predicted: float, actual: float) -> None:
        """A load's first choice predicted `predicted` seconds to its first token; it took `actual`. (A new tuple
        each time: the load thread reads it while the engine thread writes.)"""
        if predicted > 0:
            self.plan_errors = (*self.plan_errors[-(PLAN_ERRORS_KEPT - 1):], actual / predicted)

    def observe_overshoot(self, seconds: float) -> None:
        """A load's first token came `seconds` after what its last choice planned, stretched by plan_factor
        (negative: before)."""
        self.overshoots = (*self.overshoots[-(PLAN_ERRORS_KEPT - 1):], seconds)

    def reserve_seconds(self) -> float:
        """Kept back from the time left before any plan is held against it: the worst recent overshoot, never
        below 0."""
        return max((0.0, *self.overshoots))

    def plan_factor(self) -> float:
        """By how much a plan's seconds are stretched before they are held against the time left: the worst
        recent ratio, never below 1 (a load that came in early may have switched to quicker options on the
        way); FIRST_PLAN_FACTOR until a load was checked."""
        return max(1.0, *self.plan_errors) if self.plan_errors else FIRST_PLAN_FACTOR


def decode_seconds(level: str, link: LinkEstimate) -> float:
    """A level's decode time per chunk as measured (LinkEstimate.observe_decode); not yet measured, that of the
    slowest measured level of the same codec (CacheGen levels all decode every symbol, so their times are
    alike), else nothing."""
    if level in link.decode_seconds:
        return link.decode_seconds[level]
    same_codec = [seconds for other, seconds in link.decode_seconds.items()
                  if (other in CACHEGEN_LEVELS) == (level in CACHEGEN_LEVELS)]
    return max(same_codec, default=0.0)


def plan_seconds(plan: list[str], remaining: list[dict[str, int]], chunk_tokens: int, link: LinkEstimate,
                 decoders_busy: Sequence[float] = (), first_token: int = 0) -> float | None:
    """What loading the remaining chunks (bytes of each level, per chunk; the first one starts at token
    `first_token`) with options `plan` (one per chunk) takes: chunks are read one after another, each decoded
    once read by the first of the link's decoders to be free (`decoders_busy`: seconds until each is done with
    the chunks already read; those not named are free), and chunks left to text are prefilled after the load.
    None if it cannot be told yet."""
    read_end, text = 0.0, PrefillWork()
    decoders_free = [*decoders_busy, *[0.0] * (link.decoders - len(decoders_busy))]  # when each is next free
    for index, (option, sizes) in enumerate(zip(plan, remaining)):
        if option == TEXT:
            text += PrefillWork.span(first_token + index * chunk_tokens, chunk_tokens)
            continue
        if link.bytes_per_second is None:
            return None
        read_end += sizes.get(option, min(sizes.values())) / link.bytes_per_second
        first_free = decoders_free.index(min(decoders_free))
        decoders_free[first_free] = max(decoders_free[first_free], read_end) + decode_seconds(option, link)
    prefill = link.prefill.seconds(text) if text.tokens else 0.0
    return None if prefill is None else max(decoders_free, default=0.0) + prefill


def option_seconds(option: str, remaining: list[dict[str, int]], chunk_tokens: int, link: LinkEstimate,
                   decoders_busy: Sequence[float] = (), first_token: int = 0) -> float | None:
    """What loading every remaining chunk as `option` takes (plan_seconds)."""
    return plan_seconds([option] * len(remaining), remaining, chunk_tokens, link, decoders_busy, first_token)


def choose_option(remaining: list[dict[str, int]], chunk_tokens: int, seconds_left: float, link: LinkEstimate,
                  fixed_seconds: float = 0.0, decoders_busy: Sequence[float] = (), first_token: int = 0) -> str:
    """The option for remaining[0] (which starts at token `first_token`): text or one of its levels (keys of its
    sizes, best first). `seconds_left`: until the objective; `fixed_seconds`: what the load takes whatever is
    chosen (tokens recomputed anyway); `decoders_busy`: how long each decoder is busy with the chunks already
    read."""
    fitting = fitting_option(remaining, chunk_tokens, seconds_left, link, fixed_seconds, decoders_busy, first_token)
    if fitting is not None:
        return fitting
    if link.bytes_per_second is None:
        return DEFAULT_LEVEL if DEFAULT_LEVEL in remaining[0] else next(iter(remaining[0]))
    return quickest_option(remaining, chunk_tokens, link, decoders_busy, first_token)


def fitting_option(remaining: list[dict[str, int]], chunk_tokens: int, seconds_left: float, link: LinkEstimate,
                   fixed_seconds: float = 0.0, decoders_busy: Sequence[float] = (),
                   first_token: int = 0) -> str | None:
    """The best option whose cost for every remaining chunk (stretched by the learned margin) fits in the time
    left less the reserve: the quality the link allows (choose_option); None if none fits."""
    budget = (seconds_left - link.reserve_seconds()) / link.plan_factor()
    for option in (TEXT, *remaining[0]):
        cost = option_seconds(option, remaining, chunk_tokens, link, decoders_busy, first_token)
        if cost is not None and fixed_seconds + cost <= budget:
            return option
    return None


def quickest_option(remaining: list[dict[str, int]], chunk_tokens: int, link: LinkEstimate,
                    decoders_busy: Sequence[float] = (), first_token: int = 0) -> str:
    """The option for remaining[0] after which the load can end soonest (lookahead_seconds). Chosen again at every
    chunk, this mixes levels where a mix is quicker than any one level: while the decoders lag behind the link,
    a chunk read at float16 (little to decode) uses the link's spare time, and a CacheGen level again once the
    link is the slower of the two."""
    options = _undominated([TEXT, *remaining[0]], remaining[0], link)
    ends = {option: seconds for option in options
            if (seconds := _lookahead(option, options, remaining, chunk_tokens, link, decoders_busy, first_token))
            is not None}
    # Of equal ends, the fewer bytes: on this machine reads take CPU from the decoders too.
    return min(ends, key=lambda option: (ends[option], -QUALITY_ORDER.index(option)))


def lookahead_seconds(option: str, remaining: list[dict[str, int]], chunk_tokens: int, link: LinkEstimate,
                      decoders_busy: Sequence[float] = (), first_token: int = 0) -> float | None:
    """What the load takes with remaining[0] at `option` and the rest at whichever one option is then quickest;
    None if it cannot be told yet."""
    rests = _undominated([TEXT, *remaining[0]], remaining[0], link)
    return _lookahead(option, rests, remaining, chunk_tokens, link, decoders_busy, first_token)


def _lookahead(option: str, rests: list[str], remaining: list[dict[str, int]], chunk_tokens: int,
               link: LinkEstimate, decoders_busy: Sequence[float], first_token: int) -> float | None:
    """lookahead_seconds, the rest of the load at each of `rests` in turn."""
    ends = [seconds for rest in rests
            if (seconds := plan_seconds([option, *[rest] * (len(remaining) - 1)], remaining, chunk_tokens, link,
                                        decoders_busy, first_token)) is not None]
    return min(ends, default=None)


def _undominated(options: list[str], sizes: dict[str, int], link: LinkEstimate) -> list[str]:
    """The options that can make a load quicker: text, and the levels no other level beats in bytes and in decode
    time both (a load's time never falls when a chunk's bytes or decode time grow). A CacheGen level is also beaten
    by any CacheGen level with fewer bytes, whatever their measured times: the levels code the same symbols, so
    fewer bits never decode slower, and a level that measured quicker by the cores' other work alone would send
    more bytes for nothing."""
    costs = {option: (sizes[option], decode_seconds(option, link)) for option in options if option != TEXT}
    fewest_cachegen_bytes = min((sizes[option] for option in costs if option in CACHEGEN_LEVELS), default=None)

    def dominated(option: str) -> bool:
        if option in CACHEGEN_LEVELS and sizes[option] > fewest_cachegen_bytes:
            return True
        return any(other != costs[option] and other[0] <= costs[option][0] and other[1] <= costs[option][1]
                   for other in costs.values())

    return [option for option in options if option == TEXT or not dominated(option)]


def planned_seconds(option: str, remaining: list[dict[str, int]], chunk_tokens: int, seconds_left: float,
                    link: LinkEstimate, fixed_seconds: float = 0.0, decoders_busy: Sequence[float] = (),
                    first_token: int = 0) -> float | None:
    """What choosing `option` for remaining[0] plans for the rest of the load, to its end (held against the time it
    took: LinkEstimate.observe_plan): every remaining chunk at that option where it was the one that fits, else
    (the quickest, looking ahead) the lookahead's plan. None if it cannot be told yet."""
    fits = fitting_option(remaining, chunk_tokens, seconds_left, link, fixed_seconds, decoders_busy,
                          first_token) == option
    seconds = (option_seconds if fits else lookahead_seconds)(option, remaining, chunk_tokens, link, decoders_busy,
                                                              first_token)
    return None if seconds is None else fixed_seconds + seconds


def below_allowed(option: str, remaining: list[dict[str, int]], chunk_tokens: int, seconds_left: float,
                  measured: LinkEstimate, fixed_seconds: float = 0.0, decoders_busy: Sequence[float] = (),
                  first_token: int = 0) -> bool:
    """Whether `option`, chosen for remaining[0], is below the quality the link as its own read `measured` it
    allowed: the best option that would have fit the time left with that throughput. Where none would have
    fit, the link allowed no quality and the quickest was right: False."""
    allowed = fitting_option(remaining, chunk_tokens, seconds_left, measured, fixed_seconds, decoders_busy,
                             first_token)
    return allowed is not None and quality_rank(allowed) < quality_rank(option)


def quality_rank(option: str) -> int:
    """0 for text, then 1, 2, ... down the levels: lower is better."""
    return QUALITY_ORDER.index(option)
