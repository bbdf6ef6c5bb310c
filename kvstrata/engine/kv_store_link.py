"""The engine's side of the KV store (kv/store/): look a new request's prompt up below the device pool in
the background, hold the request back until its chunks are fetched and decoded, and write the chunks a
prefill computed down to the store, also in the background (kv_store_writes.py). Chunks stored at several
levels are streamed: each one is read at the level the link allows before the time-to-first-token objective,
or recomputed from its text (kv/store/adaptation.py), and the chunks read are decoded, several at once, while
the next is read.

Neither direction can fail a request: a store that is unreachable, slow or holds a corrupt object only
means that the request's tokens are prefilled from their text, and a failed write is counted and skipped.
Chunks are keyed by the chained hash of their tokens under the engine's namespace (model fingerprint,
device stored form), as the prefix cache's blocks are (each object names its own form); requests whose KV
came from a saved context (they carry a salt) are neither looked up nor written.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from kvstrata.engine.important_prefix_load import (
    ChunkGone,
    ImportantLoading,
    ImportantLoadStats,
    load_important_prefix,
)
from kvstrata.engine.kv_store_writes import StoreWrites
from kvstrata.engine.torch_threads import use_torch_threads
from kvstrata.kv.block_hash import full_block_hashes
from kvstrata.kv.impress.node_reordering import Reorderer
from kvstrata.kv.impress.prefix_selection import probe_kv_heads
from kvstrata.kv.preloaded import PreloadedKV
from kvstrata.kv.storage import KVStorage
from kvstrata.kv.store.adaptation import (
    TEXT,
    LinkEstimate,
    below_allowed,
    choose_option,
    decode_seconds,
    planned_seconds,
)
from kvstrata.kv.store.chunk_heat import ChunkHeat
from kvstrata.kv.store.emulated_link import EmulatedLink, parse_trace
from kvstrata.kv.store.errors import CorruptObject, StoreUnavailable
from kvstrata.kv.store.eviction import make_policy
from kvstrata.kv.store.forms import parse_tier_forms, stored_form
from kvstrata.kv.store.prefill_speed import PrefillSpeed, PrefillWork
from kvstrata.kv.store.spec import parse_tiers
from kvstrata.kv.store.tiered_store import Fetched, Located, StoreShape, TieredStore

if TYPE_CHECKING:
    from kvstrata.cachegen.profile import CodecProfile

log = logging.getLogger("kvstrata.kv.store")
PROBE_BYTES = 256 * 2**10  # a load's first read, at the best level, that tells the link before any choice
PIECE_BYTES = 2**20  # an adapting chunk is read in pieces of about this size (KVStoreLink._read_chunk)
SLOWED = 0.5  # a piece that got less than this share of the throughput estimated: the link slowed (not jitter)
SLOW_PIECE_SECONDS = 0.01  # unless it took less: such a read is loopback and the cores' other work, not the link


@dataclass
class LinkStats:
    requests_looked_up: int = 0
    requests_loaded: int = 0  # got at least one chunk from the store
    loaded_tokens: int = 0
    load_failures: int = 0  # loads cut short by an unreachable tier or a corrupt object (the rest recomputed)
    chunks_queued: int = 0
    writes_skipped: int = 0  # chunks not written: the write backlog was full, or reading them failed
    chunks_by_option: dict[str, int] = field(default_factory=dict)  # chunks stored at several levels: as loaded
    chunks_below_allowed: int = 0  # loaded below what the throughput that chunk's read got allowed (adaptation.py)
    chunks_switched: int = 0  # finished at another level after the link slowed during their read (by their last)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class StoreLoad:
    """A request's load in flight: its prompt's chunk keys (of the chunks before its last token) and the first
    chunk it reads (those before are in the device pool). Requests with one prompt share the future."""

    seq: object
    future: Future
    keys: list[str]
    first: int


def make_store(spec: str, forms: str, compute_dtype: torch.dtype, namespace: str, model_config,
               timeout: float, profile: CodecProfile | None = None, link_trace: str | None = None,
               probe_keys: bool = False, eviction: str = "lru") -> TieredStore:
    """`profile`: the model's CacheGen profile (the CacheGen forms' steps come from its sensitivity), or None;
    `link_trace`: the bandwidth trace an emulated link gives the Redis tiers' reads (emulated_link.py), or None;
    `probe_keys`: chunks also carry IMPRESS's probe keys (and live in a namespace of their own); `eviction`: what
    the host tier keeps when full (kv/store/eviction.py)."""
    heat = ChunkHeat()
    tiers = parse_tiers(spec, timeout, make_policy(eviction, heat))
    for tier in tiers:
        if tier.name != "redis":
            continue
        if link_trace is not None:
            tier.link = EmulatedLink(parse_trace(link_trace))
        try:  # a server that is down, or a mistyped address, is said at the start, not only at a first long prompt
            tier.ping()
        except StoreUnavailable as exc:
            log.warning("%s (the tier is skipped while it stays unreachable, and asked again every %g s)",
                        exc, tier.retry_seconds)
    tier_forms = [stored_form(name, compute_dtype, profile)
                  for name in parse_tier_forms(forms, [t.name for t in tiers])]
    probes = probe_kv_heads(model_config.num_heads, model_config.num_kv_heads) if probe_keys else 0
    if probe_keys:  # chunks holding probe keys are another kind of object: engines that read them find only those
        namespace += f"probe{probes}/"
    if profile is not None and profile.has_transforms:  # objects coded over its components decode only with it
        namespace += f"cachegen-{profile.digest}/"
    shape = StoreShape(namespace, model_config.num_layers, model_config.num_kv_heads, model_config.head_dim)
    return TieredStore(tiers, tier_forms, shape, profile=profile, probe_kv_heads=probes, heat=heat)


class KVStoreLink:
    def __init__(self, store: TieredStore, chunk_tokens: int, kv_manager, kv_cache: KVStorage,
                 prefill: PrefillSpeed | None = None, ttft_slo: float | None = None, level: str = "auto",
                 important: ImportantLoading | None = None):
        """`important`: load stored prefixes by importance (important_prefix_load.py); None: whole."""
        self.store = store
        self.important = important
        self.important_stats = ImportantLoadStats()
        self.chunk_tokens = chunk_tokens
        self.ttft_slo = ttft_slo  # seconds from a request's arrival to its first token: what streaming aims at
        self.level = level  # "auto" or the level every chunk stored at several levels is read at
        decoders = torch.get_num_threads()  # one chunk per core: the rANS coder runs without the GIL
        self.estimate = LinkEstimate(prefill=prefill or PrefillSpeed(), decoders=decoders)
        self.kv_manager = kv_manager
        self.kv_cache = kv_cache
        self.root = store.shape.namespace.encode()
        self.stats = LinkStats()
        self._loads: dict[str, StoreLoad] = {}
        # Decoding and encoding run many small torch ops per object: off the main thread, each spread over the
        # engine's threads runs about twice as slowly as on one, so those threads use one each (and chunks are
        # decoded side by side, as many as the engine has threads); the load thread (IMPRESS scores a prefix's
        # tokens there) keeps the engine's count (torch_threads.py).
        self._load_thread = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-store-load",
                                               initializer=use_torch_threads, initargs=(torch.get_num_threads(),))
        self._decoders = ThreadPoolExecutor(decoders, thread_name_prefix="kvstrata-store-decode",
                                            initializer=use_torch_threads, initargs=(1,))
        self.writes = StoreWrites(store, chunk_tokens, kv_cache, self.stats, self.chunk_keys)
        self._lock = threading.Lock()
        reorders = important is not None and important.method == "impress" and important.reorder_seconds > 0
        self.reorderer = Reorderer(store, chunk_tokens, important.reorder_seconds) if reorders else None

    # --- loads --------------------------------------------------------------------------------

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def chunk_keys(self, token_ids: list[int], num_chunks: int, salt: bytes = b"") -> list[str]:
        """The keys of the first `num_chunks` chunks of `token_ids`, in the chain `salt` starts (`store_salt`)."""
        hashes = full_block_hashes(token_ids[: num_chunks * self.chunk_tokens], self.chunk_tokens, [],
                                   self.root + salt)
        return [h.hex() for h in hashes]

    def begin_load(self, seq) -> bool:
        """Start fetching the chunks of `seq`'s prompt that the device pool lacks; False if there is nothing to
        look up (the caller schedules it at once)."""
        usable = (seq.num_tokens - 1) // self.chunk_tokens  # the last token is always computed: its logits
        if usable == 0 or seq.preloaded or seq.store_salt is None or not seq.reads_cached_prefix:
            return False
        first = self.kv_manager.cached_prefix_tokens(seq) // self.chunk_tokens
        if first >= usable:
            return False
        self.stats.requests_looked_up += 1
        # Requests with one prompt (the `n` samples of a request) share one load: its chunks are read and decoded
        # once and moved to the device once; the first admitted places them, the others find them in the device
        # pool. (Each request still counts in `stats`: requests_loaded and loaded_tokens are per request.)
        keys = self.chunk_keys(seq.token_ids, usable, seq.store_salt)
        same = next((load.future for load in self._loads.values()
                     if load.seq.token_ids == seq.token_ids and load.keys == keys), None)
        if same is None:
            same = self._load_thread.submit(self._load, seq, keys, first, self._sharing(keys, first))
        self._loads[seq.request_id] = StoreLoad(seq, same, keys, first)
        return True

    def _sharing(self, keys: list[str], first: int) -> tuple[Future, int] | None:
        """The load in flight that reads the most of this prompt's chunks from `first` on (requests asking about
        one document, arrived together), and the chunk where their prompts part; None if there is none. Of loads
        reading as much, the latest: were an earlier one cancelled, the latest read the chunks anew. Loads by
        importance are never shared: what a request reads of a prefix depends on its own new tokens."""
        if self.important is not None:
            return None
        best = None
        for load in self._loads.values():
            end = first
            while end < min(len(keys), len(load.keys)) and keys[end] == load.keys[end]:
                end += 1  # the keys chain every token before: one key equal means every earlier one is
            if load.first <= first < end and (best is None or end >= best[1]):
                best = (load.future, end)
        return best

    def _load(self, seq, keys: list[str], first: int, sharing: tuple[Future, int] | None = None) -> list[PreloadedKV]:
        """On the load thread: the chunks from `first` on, up to the first one no tier holds, as ranges of KV.
        What an earlier load `sharing` read of them is taken from it (it ran before on this thread); the chunks
        after are read here. Each chunk stored at several levels is read at the level `_pick` chooses, or left to
        be recomputed from its text; the chunks read are decoded on the decoder threads while the next one is
        read. A chunk that turns out corrupt is recomputed; an unreachable tier ends the load (the rest is
        recomputed)."""
        start = first
        shared = [] if sharing is None else self._shared_ranges(*sharing, first)
        first += sum(kv.end - kv.start for kv in shared) // self.chunk_tokens
        self.store.begin_load()
        found = self.find(keys[first:])
        if self.important is not None and first == 0 and found and all(w.level_bytes is None for w in found):
            ranges = self._load_important(seq, found)
            if ranges is not None:
                return ranges
        loads_end = (first + len(found)) * self.chunk_tokens
        recomputed = PrefillWork.span(loads_end, seq.num_tokens - loads_end)  # prefilled whatever happens
        decoding: dict[int, Future] = {}
        levels: dict[int, str | None] = {}  # of the chunks read
        started: dict[int, float] = {}  # when each chunk's decoding began (set by the decoder threads)
        planned = False  # whether this load's first adaptive choice was made (its prediction is checked later)
        for index, where in enumerate(found):
            chunk = first + index
            probe = self._probe(where) if index == 0 and self._adapts(where) else None
            level, seconds_left = None, self._seconds_left(seq)
            if where.level_bytes is not None:
                busy = self._decoders_busy(decoding, levels, started)
                level = self._pick(found[index:], chunk, recomputed, seconds_left, busy)
                if self._adapts(where) and (not planned or index == len(found) - 1):  # its first and last choice
                    predicted = self._plan_seconds(level, found[index:], chunk, recomputed, seconds_left, busy)
                    plan = None if predicted is None else (time.perf_counter(), predicted)
                    if not planned:
                        seq.store_plan, planned = plan, True
                    elif plan is not None:
                        seq.store_last_plan = (plan[0], plan[1] * self.estimate.plan_factor())
                if level == TEXT:
                    self._count_option(TEXT)
                    recomputed += self._chunk_prefill(chunk)
                    continue
            first_layer = 0 if probe is None else len(probe.objects) // 2
            try:
                fetched, read_at = self._read_chunk(found[index:], chunk, level, first_layer, recomputed, seq,
                                                    busy if level is not None else ())
            except StoreUnavailable as exc:
                log.warning("a KV store load stopped at chunk %s, the rest is recomputed: %s", where.key[:16], exc)
                self._count_load_failure()
                break
            except CorruptObject as exc:
                log.warning("chunk %s of the KV store is corrupt and is recomputed: %s", where.key[:16], exc)
                self._count_load_failure()
                fetched, read_at = None, level
            if read_at is not None:
                self._count_option(read_at)
            if fetched is None:
                recomputed += self._chunk_prefill(chunk)
                continue
            if self._adapts(where):
                self._count_below_allowed(fetched, found[index:], chunk, level, recomputed, seconds_left, busy)
            whole = fetched if probe is None else probe.joined(fetched)
            timed = read_at if read_at == level else None  # a chunk read at two levels says nothing of either's time
            decoding[chunk] = self._decoders.submit(self._decode, whole, timed, started, chunk)
            levels[chunk] = read_at
        ranges = shared + self._ranges(decoding)
        if ranges:
            seq.store_load_end = (time.perf_counter(), self._recomputed(ranges, start * self.chunk_tokens,
                                                                         seq.num_tokens))
        return ranges

    def _shared_ranges(self, earlier: Future, end: int, first: int) -> list[PreloadedKV]:
        """The KV another load read of chunks `first` to `end`, from chunk `first` up to its first gap (views of
        its tensors); none if that load was cancelled or failed (the chunks are read again)."""
        if earlier.cancelled() or earlier.exception() is not None:
            return []
        shared, position = [], first * self.chunk_tokens
        for kv in earlier.result():
            if kv.end <= position:
                continue  # chunks before this prompt's first one to read
            part = kv.between(position, end * self.chunk_tokens)
            if part is None or part.start != position:
                break  # a gap (a chunk recomputed, or the prompts part): the rest is read here
            shared.append(part)
            position = part.end
        return shared

    def _load_important(self, seq, found: list[Located]) -> list[PreloadedKV] | None:
        """On the load thread: the prefix `found` holds, read by importance while the prompt's new tokens are
        prefilled over it (all but its last token, which the engine computes); None if a chunk lacks an object
        (the load reads whole chunks instead), [] if the store failed (the prompt is prefilled from its text)."""
        try:
            kv = load_important_prefix(self.important, self.store, found, self.chunk_tokens,
                                       seq.token_ids[: seq.num_tokens], self.important_stats)
        except ChunkGone as exc:
            log.info("request %s: its stored prefix is read whole: %s", seq.request_id, exc)
            return None
        except (StoreUnavailable, CorruptObject) as exc:
            log.warning("request %s: its prefix could not be loaded by importance and is recomputed: %s",
                        seq.request_id, exc)
            self._count_load_failure()
            return []
        seq.store_load_end = (time.perf_counter(), PrefillWork.span(seq.num_tokens - 1, 1))
        return [kv]

    def _count_load_failure(self) -> None:
        """Counted from the load, decode and engine threads alike."""
        with self._lock:
            self.stats.load_failures += 1

    def find(self, keys: list[str]) -> list[Located]:
        """Where each chunk is, up to the first one no tier holds (or that cannot be looked up)."""
        found = []
        for key in keys:
            try:
                where = self.store.find(key, self.chunk_tokens)
            except (StoreUnavailable, CorruptObject) as exc:
                log.warning("a KV store lookup stopped at chunk %s, the rest is recomputed: %s", key[:16], exc)
                self._count_load_failure()
                break
            if where is None:
                break
            found.append(where)
        return found

    def _seconds_left(self, seq) -> float | None:
        """Until `seq`'s time-to-first-token objective, counted from its arrival; None without one."""
        return None if self.ttft_slo is None else self.ttft_slo - (time.perf_counter() - seq.arrival_time)

    def _adapts(self, where: Located) -> bool:
        """Whether the level of this chunk is chosen from the link as measured (stored at several levels, no
        fixed level, an objective to meet)."""
        return where.level_bytes is not None and self.level == "auto" and self.ttft_slo is not None

    def _probe(self, where: Located) -> Fetched | None:
        """The first layers of a load's first chunk (about PROBE_BYTES) at its best level, read before its level
        is chosen: the throughput they got is the estimate for that choice, rather than the link as the
        previous load left it. None if the read failed (the chunk's own read meets the failure again)."""
        best = next(iter(where.level_bytes))
        per_layer = where.level_bytes[best] / self.store.shape.num_layers
        layers = min(math.ceil(PROBE_BYTES / per_layer), self.store.shape.num_layers - 1)
        try:
            probe = self.store.read(where, best, range(layers))
        except (StoreUnavailable, CorruptObject):
            return None
        if probe is not None:
            self.estimate.bytes_per_second = probe.bytes_per_second
        return probe

    def _chunk_prefill(self, chunk: int) -> PrefillWork:
        """Recomputing chunk number `chunk` from its text."""
        return PrefillWork.span(chunk * self.chunk_tokens, self.chunk_tokens)

    def _recomputed(self, ranges: list[PreloadedKV], start: int, end: int) -> PrefillWork:
        """The prefill left between token `start` and `end` around the loaded `ranges`."""
        work, position = PrefillWork(), start
        for kv in ranges:
            work += PrefillWork.span(position, kv.start - position)
            position = kv.end
        return work + PrefillWork.span(position, end - position)

    def _pick(self, remaining: list[Located], chunk: int, recomputed: PrefillWork, seconds_left: float | None,
              busy: tuple[float, ...] = ()) -> str:
        """The level (or TEXT) of remaining[0], chunk number `chunk`, stored at several levels: the fixed
        `--kv-store-level`, the best one without `--ttft-slo`, else the adaptive choice (adaptation.py) for
        `seconds_left`, given the prefill `recomputed` anyway, the decoders `busy` for that long with the chunks
        already read, and the link as last measured."""
        levels = remaining[0].level_bytes
        if self.level != "auto":
            return self.level if self.level in levels else next(iter(levels))
        if seconds_left is None:
            return next(iter(levels))
        return choose_option(*self._plan_inputs(remaining, chunk, seconds_left, self.estimate, recomputed, busy))

    def _plan_seconds(self, option: str, remaining: list[Located], chunk: int, recomputed: PrefillWork,
                      seconds_left: float, busy: tuple[float, ...]) -> float | None:
        """What the estimates say the rest of the load takes, to the first token, with `option` chosen for
        remaining[0] (adaptation.planned_seconds); None while they cannot tell (prefill speed or the option's
        decode time not measured yet: a first load's plan is a guess, and its error says nothing of the
        estimates)."""
        link = self.estimate
        if link.prefill.seconds(recomputed) is None or (option != TEXT and decode_seconds(option, link) == 0.0):
            return None
        return planned_seconds(option, *self._plan_inputs(remaining, chunk, seconds_left, link, recomputed, busy))

    def _plan_inputs(self, remaining: list[Located], chunk: int, seconds_left: float, link: LinkEstimate,
                     recomputed: PrefillWork, busy: tuple[float, ...]) -> tuple:
        """The planner's arguments (adaptation.py) after the option: the bytes of each level of the remaining
        chunks stored at several levels, the chunk size, the time left, the link, what the load takes whatever is
        chosen (the prefill left anyway, what follows the load), the decoders' busy times and the first token."""
        fixed = link.after_load_seconds + (link.prefill.seconds(recomputed) or 0.0)
        sizes = [where.level_bytes for where in remaining if where.level_bytes is not None]
        return sizes, self.chunk_tokens, seconds_left, link, fixed, busy, chunk * self.chunk_tokens

    def _decoders_busy(self, decoding: dict[int, Future], levels: dict[int, str | None],
                       started: dict[int, float]) -> tuple[float, ...]:
        """Seconds until each decoder is done with the chunks read so far, as the estimates tell: a chunk being
        decoded takes what its level's time leaves of it, and those queued go, in the order they were read, to
        the first decoder free (chunks not stored at several levels are not counted: their time is unknown)."""
        now = time.perf_counter()
        busy, queued = [], []
        for chunk, future in decoding.items():
            if future.done() or levels[chunk] is None:
                continue
            seconds = decode_seconds(levels[chunk], self.estimate)
            if chunk in started:
                busy.append(max(seconds - (now - started[chunk]), 0.0))
            else:
                queued.append(seconds)
        busy += [0.0] * (self.estimate.decoders - len(busy))
        for seconds in queued:
            busy[busy.index(min(busy))] += seconds
        return tuple(busy)

    def _read_chunk(self, remaining: list[Located], chunk: int, level: str | None, first_layer: int,
                    recomputed: PrefillWork, seq, busy: tuple[float, ...]) -> tuple[Fetched | None, str | None]:
        """Layers `first_layer` on of remaining[0], chunk number `chunk`, at `level` (None: a chunk stored in one
        form), and the option its last layers were read at; None for the objects if the chunk went away
        meanwhile, or if it is left to be recomputed after all (TEXT). A chunk whose level adapts is read in
        pieces of about PIECE_BYTES: when a piece gets less than SLOWED of the throughput estimated (and took
        SLOW_PIECE_SECONDS at least), the rest of the chunk goes to the option chosen again from that piece's
        throughput, among those no larger (fewer bytes are what a slower link rewards; the layers read stay at
        their level and are decoded as such), so a link that drops during a large chunk's read costs one piece
        at the old level, not the whole chunk. Every read's throughput becomes the estimate for the next."""
        where, num_layers = remaining[0], self.store.shape.num_layers
        if not self._adapts(where):
            fetched = self.store.read(where, level, range(first_layer, num_layers))
            if fetched is not None and level is not None:
                self.estimate.bytes_per_second = fetched.bytes_per_second
            return fetched, level
        fetched, start = None, first_layer
        while start < num_layers:
            per_layer = where.level_bytes[level] / num_layers
            layers = range(start, min(start + max(int(PIECE_BYTES // per_layer), 1), num_layers))
            piece = self.store.read(where, level, layers)
            if piece is None:
                return None, level
            fetched, start = piece if fetched is None else fetched.joined(piece), layers.stop
            estimated, self.estimate.bytes_per_second = self.estimate.bytes_per_second, piece.bytes_per_second
            slowed = estimated is not None and piece.bytes_per_second < SLOWED * estimated
            if start < num_layers and slowed and piece.seconds >= SLOW_PIECE_SECONDS:
                size_now = where.level_bytes[level]
                rest = dataclasses.replace(where, level_bytes={option: size * (num_layers - start) // num_layers
                                                               for option, size in where.level_bytes.items()
                                                               if size <= size_now})
                switched = self._pick([rest, *remaining[1:]], chunk, recomputed, self._seconds_left(seq), busy)
                if switched == TEXT:
                    return None, TEXT
                if switched != level:
                    self.stats.chunks_switched += 1
                    level = switched
        return fetched, level

    def _count_option(self, option: str) -> None:
        self.stats.chunks_by_option[option] = self.stats.chunks_by_option.get(option, 0) + 1

    def _count_below_allowed(self, fetched: Fetched, remaining: list[Located], chunk: int, level: str,
                             recomputed: PrefillWork, seconds_left: float, busy: tuple[float, ...]) -> None:
        """A chunk chosen at `level` below the quality the throughput of its own read (`fetched`) allowed
        (adaptation.below_allowed, at the moment it was chosen) is counted: the price of the estimate lagging
        one read behind the link."""
        hindsight = dataclasses.replace(self.estimate, bytes_per_second=fetched.bytes_per_second)
        if below_allowed(level, *self._plan_inputs(remaining, chunk, seconds_left, hindsight, recomputed, busy)):
            self.stats.chunks_below_allowed += 1

    def _decode(self, fetched: Fetched, level: str | None, started: dict[int, float],
                chunk: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """On a decoder thread: K and V of read chunk number `chunk` (its start noted in `started`); None if it
        is corrupt (it is recomputed)."""
        start = started[chunk] = time.perf_counter()
        try:
            kv = self.store.decode(fetched, self.chunk_tokens)
        except CorruptObject as exc:
            log.warning("chunk %s of the KV store is corrupt and is recomputed: %s", fetched.located.key[:16], exc)
            self._count_load_failure()
            return None
        if level is not None:
            self.estimate.observe_decode(level, time.perf_counter() - start)
        return kv

    def _ranges(self, decoding: dict[int, Future]) -> list[PreloadedKV]:
        """The decoded chunks (by index) as ranges of consecutive chunks."""
        ranges, run = [], []
        for index in range(min(decoding, default=0), max(decoding, default=-1) + 2):
            kv = decoding[index].result() if index in decoding else None
            if kv is not None:
                run.append((index, kv))
                continue
            if run:
                ks, vs = zip(*(chunk for _, chunk in run))
                ranges.append(PreloadedKV(run[0][0] * self.chunk_tokens, torch.cat(ks, dim=1), torch.cat(vs, dim=1)))
            run = []
        return ranges

    def observe_prefill(self, work: PrefillWork, seconds: float) -> None:
        """A step that prefilled `work` took `seconds`: what recomputing a chunk from text costs."""
        self.estimate.prefill.observe(work, seconds)

    def observe_first_token(self, seq, now: float) -> None:
        """`seq`, loaded from the store, got its first token at `now`: what follows a load, by how much the load's
        first plan erred, and how far past the stretched plan of its last choice it came, are learned."""
        if seq.store_load_end is not None:
            self.observe_after_load(now - seq.store_load_end[0], seq.store_load_end[1])
            seq.store_load_end = None
        if seq.store_plan is not None:
            decided, predicted = seq.store_plan
            self.estimate.observe_plan(predicted, now - decided)
            seq.store_plan = None
        if seq.store_last_plan is not None:
            decided, stretched = seq.store_last_plan
            self.estimate.observe_overshoot(now - decided - stretched)
            seq.store_last_plan = None

    def observe_after_load(self, seconds: float, recomputed: PrefillWork) -> None:
        """A request's first token came `seconds` after its load ended, `recomputed` prefilled then: what follows
        every load besides prefill (placing the KV, scheduling, sampling)."""
        overhead = max(seconds - (self.estimate.prefill.seconds(recomputed) or 0.0), 0.0)
        previous = self.estimate.after_load_seconds
        self.estimate.after_load_seconds = overhead if previous == 0.0 else 0.5 * (previous + overhead)

    def take_ready(self, timeout: float = 0.0) -> list[tuple[object, list[PreloadedKV]]]:
        """Sequences whose loads ended, with the ranges of KV found (none: nothing, or the load failed). Waits up
        to `timeout` seconds for one when none has ended yet."""
        if timeout and self._loads and not any(load.future.done() for load in self._loads.values()):
            wait([load.future for load in self._loads.values()], timeout=timeout, return_when=FIRST_COMPLETED)
        ready = []
        for request_id in [r for r, load in self._loads.items() if load.future.done()]:
            load = self._loads.pop(request_id)
            seq = load.seq
            try:
                ranges = load.future.result()
            except Exception:  # a bug below, not the request's fault: it is prefilled instead
                log.exception("request %s: its KV store load failed; it is prefilled from its text", request_id)
                self._count_load_failure()
                ranges = []
            if ranges:
                self.stats.requests_loaded += 1
                self.stats.loaded_tokens += sum(kv.end - kv.start for kv in ranges)
            ready.append((seq, ranges))
        return ready

    def forget(self, request_id: str) -> None:
        """An aborted or failed request: its load is cancelled if it has not started and no other request waits on
        it, or its result dropped."""
        load = self._loads.pop(request_id, None)
        if load is not None and all(other.future is not load.future for other in self._loads.values()):
            load.future.cancel()  # no other request with its prompt waits on it (one sharing its prefix reads anew)

    # --- writes (kv_store_writes.py) -----------------------------------------------------------

    def store_prompt(self, seq, reused_tokens: int) -> None:
        self.writes.store_prompt(seq, reused_tokens)

    def flush(self) -> None:
        """Wait until every queued write is done (tests, tools, shutdown)."""
        self.writes.flush()

    def close(self) -> None:
        if self.reorderer is not None:
            self.reorderer.stop()
        self._load_thread.shutdown(wait=False, cancel_futures=True)
        self._decoders.shutdown(wait=False, cancel_futures=True)
        self.writes.close()
        self.store.close()
