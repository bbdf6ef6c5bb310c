"""Which level each chunk of a streamed context is loaded at, or whether its tokens are recomputed from text
(CacheGen §4, Algorithm 1; papers/cachegen.md §3), with an explicit quality order: text (lossless), then the
stored levels best first.

For the next chunk, an option's cost is what loading every remaining chunk that way would take, at the
throughput the last chunk read got (assumed to hold). Reading and decoding are two resources working side by
side (chunk i is decoded while chunk i + 1 is read), so the load is simulated chunk by chunk (plan_seconds);
text costs its tokens' prefill, after the load, at their place in the context (prefill_speed.py). The best
option whose cost, with the tokens recomputed anyway, fits in the time left before the objective less a margin
(PLAN_MARGIN: the estimates err, and a plan that uses every second it believes it has lands just past the
objective) is chosen; if none fits, the quickest. Before any throughput is known, a level is DEFAULT_LEVEL.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.cachegen.levels import CACHEGEN_LEVELS
from kvstrata.kv.store.forms import STREAMED_LEVELS
from kvstrata.kv.store.prefill_speed import PrefillSpeed, PrefillWork

TEXT = "text"
QUALITY_ORDER = (TEXT, *STREAMED_LEVELS)  # best first
DEFAULT_LEVEL = "medium"  # the paper's choice for a first chunk when nothing is known of the link
PLAN_MARGIN = 0.1  # of the time left, kept free when planning


@dataclass
class LinkEstimate:
    bytes_per_second: float | None = None  # what the last chunk read got
    decode_seconds: dict[str, float] = field(default_factory=dict)  # per chunk, by level, as last measured
    prefill: PrefillSpeed = field(default_factory=PrefillSpeed)  # the engine's recent prefill speed
    after_load_seconds: float = 0.0  # from a load's end to the first token, prefill aside (placing the KV, ...)


def decode_seconds(level: str, link: LinkEstimate) -> float:
    """A level's decode time per chunk as last measured; not yet measured, that of the slowest measured level of
    the same codec (CacheGen levels all decode every symbol, so their times are alike), else nothing."""
    if level in link.decode_seconds:
        return link.decode_seconds[level]
    same_codec = [seconds for other, seconds in link.decode_seconds.items()
                  if (other in CACHEGEN_LEVELS) == (level in CACHEGEN_LEVELS)]
    return max(same_codec, default=0.0)


def plan_seconds(plan: list[str], remaining: list[dict[str, int]], chunk_tokens: int, link: LinkEstimate,
                 decode_backlog: float = 0.0, first_token: int = 0) -> float | None:
    """What loading the remaining chunks (bytes of each level, per chunk; the first one starts at token
    `first_token`) with options `plan` (one per chunk) takes: chunks are read one after another, each decoded
    once read and once the decodes before it are done (those of chunks already read take `decode_backlog`),
    and chunks left to text are prefilled after the load. None if it cannot be told yet."""
    read_end, decode_end, text = 0.0, decode_backlog, PrefillWork()
    for index, (option, sizes) in enumerate(zip(plan, remaining)):
        if option == TEXT:
            text += PrefillWork.span(first_token + index * chunk_tokens, chunk_tokens)
            continue
        if link.bytes_per_second is None:
            return None
        read_end += sizes.get(option, min(sizes.values())) / link.bytes_per_second
        decode_end = max(decode_end, read_end) + decode_seconds(option, link)
    prefill = link.prefill.seconds(text) if text.tokens else 0.0
    return None if prefill is None else decode_end + prefill


def option_seconds(option: str, remaining: list[dict[str, int]], chunk_tokens: int, link: LinkEstimate,
                   decode_backlog: float = 0.0, first_token: int = 0) -> float | None:
    """What loading every remaining chunk as `option` takes (plan_seconds)."""
    return plan_seconds([option] * len(remaining), remaining, chunk_tokens, link, decode_backlog, first_token)


def choose_option(remaining: list[dict[str, int]], chunk_tokens: int, seconds_left: float, link: LinkEstimate,
                  fixed_seconds: float = 0.0, decode_backlog: float = 0.0, first_token: int = 0) -> str:
    """The option for remaining[0] (which starts at token `first_token`): text or one of its levels (keys of its
    sizes, best first). `seconds_left`: until the objective; `fixed_seconds`: what the load takes whatever is
    chosen (tokens recomputed anyway); `decode_backlog`: decoding the chunks already read."""
    options = [TEXT, *remaining[0]]
    budget = seconds_left * (1 - PLAN_MARGIN)
    costs = {option: option_seconds(option, remaining, chunk_tokens, link, decode_backlog, first_token)
             for option in options}
    for option in options:
        if costs[option] is not None and fixed_seconds + costs[option] <= budget:
            return option
    if link.bytes_per_second is None:
        return DEFAULT_LEVEL if DEFAULT_LEVEL in remaining[0] else next(iter(remaining[0]))
    # Of equal costs (levels alike in decoding, the slowest part), the fewer bytes: on this machine their reads
    # take CPU from the decoder too. (Mixing levels when nothing fits, a float16 read while the decoder catches
    # up, was tried at commit f191030: at 0.1 Gbps its loads came out slower than fixed "low".)
    known = {option: cost for option, cost in costs.items() if cost is not None}
    return min(known, key=lambda option: (known[option], -QUALITY_ORDER.index(option)))


def quality_rank(option: str) -> int:
    """0 for text, then 1, 2, ... down the levels: lower is better."""
    return QUALITY_ORDER.index(option)
