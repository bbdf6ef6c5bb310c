"""Streaming stored contexts (CacheGen §4): chunks stored at several levels, the level chooser on synthetic
throughput traces, the emulated link, and the engine loading each chunk at the level the link allows."""

import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from kvstrata.engine.kv_store_link import PIECE_BYTES, KVStoreLink
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.errors import KvstrataError
from kvstrata.kv.store.adaptation import (
    DEFAULT_LEVEL,
    FIRST_PLAN_FACTOR,
    PLAN_ERRORS_KEPT,
    TEXT,
    LinkEstimate,
    below_allowed,
    choose_option,
    option_seconds,
    planned_seconds,
    quality_rank,
)
from kvstrata.kv.store.disk_tier import DiskTier
from kvstrata.kv.store.emulated_link import BURST_BYTES, BYTES_PER_GBIT, EmulatedLink, Segment, parse_trace
from kvstrata.kv.store.errors import CorruptObject
from kvstrata.kv.store.forms import STREAMED_LEVELS, stored_form
from kvstrata.kv.store.host_tier import HostTier
from kvstrata.kv.store.objects import ObjectHeader, pack_object
from kvstrata.kv.store.prefill_speed import PrefillSpeed, PrefillWork
from kvstrata.kv.store.redis_tier import RedisTier
from kvstrata.kv.store.tiered_store import MANIFEST, Fetched, Located
from kvstrata.server.metrics import ServerMetrics
from tests.test_kv_store_engine import CHUNK, PROMPTS, make_engine, run_rounds, tier_hits
from tests.test_kv_store_tiers import SHAPE, TOKENS, chunk_kv, store_over

# --- chunks stored at several levels ----------------------------------------------------------


def test_a_chunk_in_the_levels_form_is_read_at_any_level_and_only_that_level_travels(redis_server):
    tier = RedisTier(redis_server.url)
    store = store_over(tier, forms=["levels"])
    k, v = chunk_kv(0)
    store.put("c0", k, v)
    where = store.find("c0", TOKENS)
    assert list(where.level_bytes) == list(STREAMED_LEVELS)
    sizes = list(where.level_bytes.values())
    assert sizes == sorted(sizes, reverse=True)  # better levels are bigger
    errors = []
    for level, size in where.level_bytes.items():
        before = tier.stats.bytes_read
        fetched = store.read(where, level)
        assert tier.stats.bytes_read - before == fetched.num_bytes == size
        got_k, got_v = store.decode(fetched, TOKENS)
        errors.append(float((got_k - k).pow(2).mean() + (got_v - v).pow(2).mean()))
    assert errors == sorted(errors) and errors[0] < 1e-5 < errors[-1]  # float16 first, the lossiest level last
    assert torch.allclose(store.fetch("c0", TOKENS)[0], k, atol=2e-3)  # without a choice: the best level


def test_a_corrupt_manifest_drops_the_chunk():
    host = HostTier(10**8)
    store = store_over(host, forms=["levels"])
    foreign_level = pack_object(ObjectHeader(SHAPE.namespace, "c0", MANIFEST, "levels", ()), b'{"zip": 3}')
    for manifest, message in ((b"garbage", "truncated"), (foreign_level, "expected a subset")):
        store.put("c0", *chunk_kv(0))
        host._chunks["c0"][MANIFEST] = manifest
        with pytest.raises(CorruptObject, match=message):
            store.find("c0", TOKENS)
        assert not host.contains("c0")


def test_a_chunk_dropped_from_a_levels_tier_moves_down_at_its_best_level(tmp_path):
    chunk_bytes = sum(len(data) for data in store_over(HostTier(1), forms=["levels"]).encode("c0", *chunk_kv(0),
                                                                               stored_form("levels", torch.float32)).values())
    host, disk = HostTier(int(1.5 * chunk_bytes)), DiskTier(tmp_path, 10**8)
    store = store_over(host, disk, forms=["levels", "raw"])
    store.put("c0", *chunk_kv(0))
    disk.remove("c0")
    store.put("c1", *chunk_kv(1))  # the host tier drops c0; the disk tier gets its float16 level as raw
    assert not host.contains("c0") and disk.contains("c0")
    assert torch.allclose(store.fetch("c0", TOKENS)[0], chunk_kv(0)[0], atol=2e-3)


# --- the chooser on synthetic traces ----------------------------------------------------------

# Bytes per chunk at each level, as the default model's 256-token chunks roughly are (float16 ~5.9 MB).
SIZES = {"float16": 5_900_000, "near-lossless": 2_000_000, "high": 1_200_000, "medium": 880_000, "low": 570_000}
MBPS = 1e6


def stream(trace, slo: float, chunks: int = 8, decide=choose_option, prefill_per_token: float = 0.002):
    """Simulate a load chunk by chunk over `trace` (bytes/s as a function of time): the option of each chunk, when
    the load ended, and per chunk whether its option was below what its own throughput allowed."""
    link = LinkEstimate(prefill=PrefillSpeed(per_token=prefill_per_token))
    now, recomputed, options, below = 0.0, 0, [], []
    for index in range(chunks):
        remaining = [SIZES] * (chunks - index)
        fixed = recomputed * prefill_per_token
        option = decide(remaining, 256, slo - now, link, fixed)
        options.append(option)
        if option == TEXT:
            recomputed += 256
            continue
        rate = trace(now)
        now += SIZES[option] / rate
        below.append(below_allowed(option, remaining, 256, slo - (now - SIZES[option] / rate),
                                   LinkEstimate(rate, {}, PrefillSpeed(per_token=prefill_per_token)), fixed))
        link.bytes_per_second = rate
    return options, now + recomputed * prefill_per_token, below


def fixed(level):
    return lambda remaining, *_: level


def test_steady_links_get_the_best_level_that_fits_every_chunk():
    # 8 chunks in 1 s: float16 needs 47 MB/s, medium 7 MB/s, low 4.6 MB/s; text would take 4 s.
    for rate, expected in ((100 * MBPS, "float16"), (20 * MBPS, "near-lossless"), (8 * MBPS, "medium"),
                           (5 * MBPS, "low")):
        options, took, below = stream(lambda t, rate=rate: rate, slo=1.0)
        assert options[0] == DEFAULT_LEVEL  # nothing known of the link yet
        levels = [option for option in options[1:] if option != TEXT]  # text: the last chunks, when time is left
        # With every chunk read, time is left over: later chunks may go at better levels, never worse.
        assert options[1] == expected and max(map(quality_rank, levels)) == quality_rank(expected), rate
        assert not any(below[1:])
        assert took <= 1.0


def test_text_is_chosen_when_recomputing_fits():
    options, took, _ = stream(lambda t: 1 * MBPS, slo=5.0, prefill_per_token=0.0005)  # 8 x 256 tokens: 1 s
    assert options == [TEXT] * 8 and took <= 5.0


def test_nothing_fits_so_the_quickest_option_is_taken():
    options, _, _ = stream(lambda t: 2 * MBPS, slo=0.5)  # low: 0.29 s a chunk, text 0.51 s
    assert set(options[1:]) == {"low"}
    assert choose_option([SIZES], 256, 0.1, LinkEstimate(0.1 * MBPS, {}, PrefillSpeed(per_token=1e-6))) == TEXT  # text quicker than bytes


def test_decode_times_are_averaged_so_one_slow_chunk_does_not_swap_the_levels():
    link = LinkEstimate(1000 * MBPS)
    link.observe_decode("float16", 0.03)
    link.observe_decode("low", 0.09)
    link.observe_decode("float16", 0.11)  # one float16 chunk decoded while the other decoder held the core
    assert link.decode_seconds == {"float16": pytest.approx(0.07), "low": 0.09}
    assert choose_option([SIZES] * 4, 256, 0.01, link) == "float16"  # nothing fits: still the quicker one


def test_plans_are_stretched_by_the_worst_error_of_recent_loads():
    link = LinkEstimate(8 * MBPS, {}, PrefillSpeed(per_token=0.002))
    assert link.plan_factor() == FIRST_PLAN_FACTOR
    assert choose_option([SIZES] * 8, 256, 1.0, link) == "medium"  # 0.88 s of 0.9
    link.observe_plan(predicted=1.0, actual=1.3)  # the last load took 30% longer than its plan said
    assert link.plan_factor() == pytest.approx(1.3)
    assert choose_option([SIZES] * 8, 256, 1.0, link) == "low"  # 0.57 x 1.3 = 0.74 s of 1
    for _ in range(PLAN_ERRORS_KEPT - 1):
        link.observe_plan(predicted=1.0, actual=1.1)
    assert link.plan_factor() == pytest.approx(1.3)  # still among the recent loads
    link.observe_plan(predicted=1.0, actual=0.5)  # the 1.3 is forgotten; early loads do not shrink the margin
    assert link.plan_factor() == pytest.approx(1.1)
    for _ in range(PLAN_ERRORS_KEPT):
        link.observe_plan(predicted=1.0, actual=0.5)
    assert link.plan_factor() == 1.0 and choose_option([SIZES] * 8, 256, 0.89, link) == "medium"  # 0.88 s of 0.89
    assert choose_option([SIZES] * 8, 256, 0.89, LinkEstimate(8 * MBPS, {}, link.prefill)) == "low"  # before: 0.8
    link.observe_plan(predicted=0.0, actual=0.5)  # nothing was predicted: nothing to learn
    assert len(link.plan_errors) == PLAN_ERRORS_KEPT and link.plan_factor() == 1.0


def test_the_worst_recent_overshoot_of_a_load_s_last_choice_is_kept_back_from_the_time_left():
    link = LinkEstimate(8 * MBPS, {}, PrefillSpeed(per_token=0.002), plan_errors=(1.0,))
    assert link.reserve_seconds() == 0.0 and choose_option([SIZES] * 8, 256, 0.89, link) == "medium"  # 0.88 s
    link.observe_overshoot(-0.2)  # a load whose first token came early: nothing to keep back
    assert link.reserve_seconds() == 0.0
    link.observe_overshoot(0.05)  # one that came 50 ms past its last choice's plan
    assert link.reserve_seconds() == pytest.approx(0.05)
    assert choose_option([SIZES] * 8, 256, 0.89, link) == "low"  # medium's 0.88 s does not fit 0.84
    assert not below_allowed("low", [SIZES] * 8, 256, 0.89, link)  # what the link allowed: told with the reserve
    assert below_allowed("low", [SIZES] * 8, 256, 0.89, LinkEstimate(8 * MBPS, {}, link.prefill, plan_errors=(1.0,)))
    for _ in range(PLAN_ERRORS_KEPT - 1):
        link.observe_overshoot(0.0)
    assert link.reserve_seconds() == pytest.approx(0.05)  # still among the recent loads
    link.observe_overshoot(0.0)
    assert link.reserve_seconds() == 0.0


def test_a_slow_decoder_counts_where_it_is_slower_than_the_link():
    link = LinkEstimate(1000 * MBPS, {"float16": 0.01, "high": 0.3})
    # float16: read (5.9 ms), decode (10 ms) while the second is read, decode the second: 25.9 ms.
    assert option_seconds("float16", [SIZES] * 2, 256, link) == pytest.approx(0.0259)
    assert option_seconds("high", [SIZES] * 2, 256, link) == pytest.approx(0.0012 + 0.6)
    assert choose_option([SIZES] * 2, 256, 0.1, link) == "float16"
    assert option_seconds("low", [SIZES], 256, link) == pytest.approx(0.00057 + 0.3)  # not measured: as "high"


def test_two_decoders_share_the_chunks():
    one, two = (LinkEstimate(1000 * MBPS, {"high": 0.3}, decoders=n) for n in (1, 2))
    # four chunks read in 1.2 ms each: one decoder takes them in turn from the first read, two take two each
    # from the second
    assert option_seconds("high", [SIZES] * 4, 256, one) == pytest.approx(0.0012 + 4 * 0.3)
    assert option_seconds("high", [SIZES] * 4, 256, two) == pytest.approx(0.0024 + 2 * 0.3)
    # both decoders busy for 0.3 s: the new chunk waits for one of them
    assert option_seconds("high", [SIZES], 256, two, decoders_busy=(0.3, 0.3)) == pytest.approx(0.6)
    # one chunk still decoding for 0.6 s is not split between decoders: the other takes the new chunk at once
    assert option_seconds("high", [SIZES], 256, two, decoders_busy=(0.6,)) == pytest.approx(0.6)
    assert option_seconds("high", [SIZES] * 2, 256, two, decoders_busy=(0.6,)) == pytest.approx(0.6012)
    assert option_seconds("high", [SIZES], 256, one, decoders_busy=(0.6,)) == pytest.approx(0.9)


def test_a_load_tells_each_decoder_s_busy_time_from_the_chunks_started_and_queued():
    link = SimpleNamespace(estimate=LinkEstimate(decode_seconds={"low": 0.1, "float16": 0.02}, decoders=2))
    running, queued, done = Future(), Future(), Future()
    done.set_result(None)
    now = time.perf_counter()
    decoding = {0: done, 1: running, 2: running, 3: queued, 4: queued, 5: queued}
    levels = {0: "low", 1: "low", 2: "float16", 3: "low", 4: "float16", 5: None}  # 5: not stored at levels
    started = {0: now - 1.0, 1: now - 0.04, 2: now - 0.05}  # chunk 2 has overrun its estimate
    busy = KVStoreLink._decoders_busy(link, decoding, levels, started)
    # chunk 1 leaves 0.06 s, chunk 2 none; chunk 3 goes to the free decoder, then chunk 4 to the one with chunk 1
    assert busy == pytest.approx((0.06 + 0.02, 0.1), abs=0.01)


def load_when_nothing_fits(link: LinkEstimate, chunks: int = 15) -> tuple[list[str], float]:
    """Each chunk's option chosen as a load would (after the previous read, the decoders busy) with no time left,
    and when the load ends, the estimates being right."""
    read_end, decoders_free, options = 0.0, [0.0] * link.decoders, []
    for index in range(chunks):
        busy = tuple(max(free - read_end, 0.0) for free in decoders_free)
        option = choose_option([SIZES] * (chunks - index), 256, 0.0, link, decoders_busy=busy)
        options.append(option)
        read_end += SIZES[option] / link.bytes_per_second
        first_free = decoders_free.index(min(decoders_free))
        decoders_free[first_free] = max(decoders_free[first_free], read_end) + link.decode_seconds[option]
    return options, max(decoders_free)


def test_when_nothing_fits_levels_are_mixed_where_a_mix_is_quicker_than_any_one_level():
    # 1 Gbps: 15 float16 chunks take 0.71 s to read, 15 low ones 0.68 s for two decoders to decode
    link = LinkEstimate(125 * MBPS, {"float16": 0.03, "low": 0.09}, decoders=2)
    options, took = load_when_nothing_fits(link)
    fixed = {level: option_seconds(level, [SIZES] * 15, 256, link) for level in SIZES}
    assert {"float16", "low"} <= set(options)
    assert took < 0.8 * min(fixed.values())
    # the link alone, or the decoders alone, set every fixed level's time: nothing to mix, the fewest bytes
    assert choose_option([SIZES] * 15, 256, 0.1, LinkEstimate(125 * MBPS, {}, decoders=2)) == "low"


def test_of_two_cachegen_levels_the_one_with_fewer_bytes_is_never_the_slower_whatever_their_measured_times():
    # 0.1 Gbps: a low chunk is read in 46 ms, a medium one in 70 ms, while each of two decoders takes 0.2 s a chunk
    # (medium measured 0.18 s: the cores' other work); float16 takes 0.47 s to read.
    link = LinkEstimate(12.5 * MBPS, {"low": 0.2, "medium": 0.18, "float16": 0.02}, decoders=2)
    assert option_seconds("medium", [SIZES] * 15, 256, link) < option_seconds("low", [SIZES] * 15, 256, link)
    options, _ = load_when_nothing_fits(link)
    assert "medium" not in options and "low" in options


def test_a_link_that_drops_mid_load_is_followed_one_chunk_late_and_adaptation_meets_the_objective():
    def drop(t):
        return 100 * MBPS if t < 0.1 else 10 * MBPS

    slo = 1.0
    options, took, below = stream(drop, slo=slo, chunks=8)
    assert took <= slo and not any(below[1:])  # the first chunk goes at the default: nothing known of the link
    # float16 while the link is fast; the chunk read as the link drops is float16 too (the estimate lags one chunk),
    # then the levels that still fit.
    assert options[1:4] == ["float16"] * 3 and options[4] == "low" and set(options[5:]) <= {"low", "medium", TEXT}
    assert stream(drop, slo=slo, decide=fixed("float16"))[1] > slo


def test_a_chunk_read_as_the_link_rises_is_below_what_its_read_allowed_unless_nothing_fitted():
    options, _, below = stream(lambda t: 5 * MBPS if t < 0.3 else 100 * MBPS, slo=1.0)
    rise = below.index(True)  # chosen on the slow estimate, read at the fast rate; the next chunk catches up
    assert options[rise] == "low" and below.count(True) == 1 and options[rise + 1] == "float16"
    # Nothing would have fit even at the throughput the read got: the link allowed no quality, though the
    # quickest option for that throughput (float16, little to decode) is better than the one read.
    measured = LinkEstimate(100 * MBPS, {"float16": 0.01, "low": 1.0}, PrefillSpeed(per_token=0.002))
    assert choose_option([SIZES] * 8, 256, 0.1, measured) == "float16"
    assert not below_allowed("low", [SIZES] * 8, 256, 0.1, measured)
    assert below_allowed("low", [SIZES] * 8, 256, 1.0, measured)  # with time for float16, it is counted


def test_a_load_s_first_plan_is_the_one_its_choice_follows():
    link = LinkEstimate(125 * MBPS, {"float16": 0.03, "low": 0.09}, PrefillSpeed(per_token=0.002), decoders=2)
    remaining = [SIZES] * 15
    # time enough: every chunk at the option that fits
    fitting = choose_option(remaining, 256, 10.0, link, 0.5)
    assert planned_seconds(fitting, remaining, 256, 10.0, link, 0.5) == pytest.approx(
        0.5 + option_seconds(fitting, remaining, 256, link))
    # nothing fits: this chunk at the quickest, the rest at the quickest one option after it, which a mixed
    # load beats every single option by
    quickest = choose_option(remaining, 256, 0.1, link, 0.5)
    planned = planned_seconds(quickest, remaining, 256, 0.1, link, 0.5)
    assert planned < 0.5 + min(option_seconds(level, remaining, 256, link) for level in SIZES)


def link_reading(read_seconds, pick):
    """A KVStoreLink adapting to a 5 s objective over a store of 4-layer chunks, whose reads take
    `read_seconds(reads so far)`, and whose choice for a chunk's rest is `pick` (it records each read and the
    sizes each choice was asked about)."""
    reads, asked = [], []

    def read(where, level, layers):
        reads.append((level, layers))
        objects = {f"{kind}.{layer}": bytes(where.level_bytes[level] // 8) for layer in layers for kind in "kv"}
        return Fetched(where, objects, read_seconds(len(reads)))

    store = SimpleNamespace(shape=SimpleNamespace(namespace="ns/", num_layers=4), read=read, close=lambda: None)
    link = KVStoreLink(store, 256, kv_manager=None, kv_cache=None, ttft_slo=5.0)
    link._pick = lambda remaining, *args: asked.append(remaining[0].level_bytes) or pick
    link.estimate.bytes_per_second = 1e9
    return link, reads, asked


def test_a_link_that_slows_during_a_chunk_s_read_sends_the_rest_of_it_at_the_level_chosen_again():
    sizes = {"float16": 4 * PIECE_BYTES, "low": PIECE_BYTES // 2}  # a float16 layer is one piece
    chunk, seq = Located("c", 0, sizes), SimpleNamespace(arrival_time=time.perf_counter())
    # The second piece takes a second: the last two layers go at the level chosen again, in one piece.
    link, reads, asked = link_reading(lambda n: 1.0 if n == 2 else 1e-3, "low")
    fetched, level = link._read_chunk([chunk], 0, "float16", 0, PrefillWork(), seq, ())
    assert reads == [("float16", range(1)), ("float16", range(1, 2)), ("low", range(2, 4))]
    assert level == "low" and link.stats.chunks_switched == 1 and sorted(fetched.objects) == [
        f"{kind}.{layer}" for kind in "kv" for layer in range(4)]
    assert asked == [{"float16": 2 * PIECE_BYTES, "low": PIECE_BYTES // 4}]  # the chunk's last two layers
    assert link.estimate.bytes_per_second == pytest.approx(PIECE_BYTES / 4 / 1e-3)  # the last piece's
    link.close()
    # A link that jitters (each piece at 0.7 of the estimate) has not slowed, and reads too short to tell the
    # link from the cores' other work (a third of the estimate, in 3.5 ms) tell nothing: nothing is chosen again.
    for throughput in (0.7e9, 0.3e9):
        link, reads, asked = link_reading(lambda n, rate=throughput: PIECE_BYTES / rate, "low")
        assert link._read_chunk([chunk], 0, "float16", 1, PrefillWork(), seq, ())[1] == "float16"
        assert reads == [("float16", range(layer, layer + 1)) for layer in range(1, 4)] and asked == []
        link.close()
    # Chosen again, the chunk is left to be recomputed from its text: nothing of it is kept.
    link, reads, asked = link_reading(lambda n: 1.0, TEXT)
    assert link._read_chunk([chunk], 0, "float16", 0, PrefillWork(), seq, ()) == (None, TEXT)
    assert len(reads) == 1
    link.close()


# --- the emulated link ------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_traces_are_parsed_and_checked():
    assert parse_trace("1") == [Segment(1.0, float("inf"))]
    assert parse_trace("10:0.3, 0.1") == [Segment(10.0, 0.3), Segment(0.1, float("inf"))]
    for bad, message in (("fast", "not GBPS"), ("0", "outside"), ("10,1", "positive duration"),
                         ("10:-1,1", "positive duration")):
        with pytest.raises(KvstrataError, match=message):
            parse_trace(bad)


def test_the_emulated_link_delivers_bytes_at_the_trace_s_rate():
    clock = FakeClock()
    link = EmulatedLink(parse_trace("1:1,0.1"), clock=clock, sleep=clock.sleep)
    link.transfer(BURST_BYTES, link.now())  # a full bucket goes at once
    assert clock.now == 0.0
    link.transfer(int(0.5 * BYTES_PER_GBIT), link.now())  # half a second at 1 Gbps
    assert clock.now == pytest.approx(0.5)
    link.transfer(int(BYTES_PER_GBIT), link.now())  # 0.5 s more at 1 Gbps, then the rest at 0.1 Gbps: 5 s
    assert clock.now == pytest.approx(6.0)
    clock.now = 100.0
    link.restart()
    began = link.now()
    clock.now += 0.06  # the bytes took 60 ms to arrive on loopback: the link's 100 ms include them
    link.transfer(BURST_BYTES + int(0.1 * BYTES_PER_GBIT), began)  # the trace starts over at 1 Gbps
    assert clock.now == pytest.approx(100.1)
    clock.now += 0.5  # a read slower than the link on its own is not slowed further
    link.transfer(int(0.1 * BYTES_PER_GBIT), clock.now - 0.5)
    assert clock.now == pytest.approx(100.6)


# --- the engine streaming ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Every prompt once, without a store."""
    return run_rounds(make_engine(tiny_llama), rounds=1)


def test_an_engine_streams_chunks_at_the_level_it_is_told_and_outputs_stay_close(tiny_llama, reference, redis_server):
    run_rounds(make_engine(tiny_llama, kv_store=redis_server.url, kv_store_format="levels"), rounds=1)
    reader = make_engine(tiny_llama, kv_store=redis_server.url, kv_store_format="levels", kv_store_level="float16")
    outputs = run_rounds(reader, rounds=1)
    chunks = len(PROMPTS) * (199 // CHUNK)
    assert tier_hits(reader)["redis"] == chunks * CHUNK
    assert reader.kv_store.stats.chunks_by_option == {"float16": chunks}
    assert outputs == reference  # float16 on this model: the same tokens


def test_chunks_left_to_text_are_recomputed_between_loaded_ranges(tiny_llama, reference, redis_server):
    run_rounds(make_engine(tiny_llama, kv_store=redis_server.url, kv_store_format="levels"), rounds=1)
    reader = make_engine(tiny_llama, kv_store=redis_server.url, kv_store_format="levels", ttft_slo=10.0)
    # Of a prompt's six chunks, the first, third and fifth (an even number of chunks left) are left to text.
    reader.kv_store._pick = lambda remaining, *args: TEXT if len(remaining) % 2 == 0 else "float16"
    taken = []
    original = reader._check_preloaded
    reader._check_preloaded = lambda ranges, n, moved=None: (taken.append([(r.start, r.end) for r in ranges])
                                                        or original(ranges, n, moved))
    assert run_rounds(reader, rounds=1) == reference
    holes = [[(CHUNK, 2 * CHUNK), (3 * CHUNK, 4 * CHUNK), (5 * CHUNK, 6 * CHUNK)]]
    assert [t for t in taken if t] == holes * len(PROMPTS)
    assert reader.kv_store.stats.chunks_by_option == {TEXT: 18, "float16": 18}


def test_an_engine_with_an_objective_adapts_to_a_slow_link(tiny_llama, redis_server, monkeypatch):
    from kvstrata.kv.store import emulated_link

    monkeypatch.setattr(emulated_link, "BURST_BYTES", 0)  # a burst would carry a whole prompt of this tiny model
    run_rounds(make_engine(tiny_llama, kv_store=redis_server.url, kv_store_format="levels"), rounds=1)
    # 0.005 Gbps = 625 KB/s: a float16 chunk here (3 layers x 32 tokens x 2 x 2 heads x 16 x 2 bytes, 12 KB) takes
    # 20 ms, a prompt's 6 chunks 120 ms; a 50 ms objective leaves room for the smaller levels only.
    reader = make_engine(tiny_llama, kv_store=redis_server.url, kv_store_format="levels", ttft_slo=0.05,
                         kv_store_link_gbps="0.005")
    reader.kv_store.estimate.prefill = PrefillSpeed(per_token=1.0)  # recomputing is out of the question
    reader.kv_store.observe_prefill = lambda work, seconds: None  # and stays so
    # Every chunk is told to have decoded in 0.1 ms, so the choices answer to the link alone: where the decoders
    # lag behind it, as they do on a busy machine, float16 chunks would rightly be mixed in.
    observe_decode = reader.kv_store.estimate.observe_decode
    reader.kv_store.estimate.observe_decode = lambda level, seconds: observe_decode(level, 1e-4)
    outputs = run_rounds(reader, rounds=1)
    assert all(isinstance(tokens, list) and len(tokens) == 6 for tokens in outputs.values())
    chosen = reader.kv_store.stats.chunks_by_option
    assert sum(chosen.values()) == len(PROMPTS) * (199 // CHUNK) and "float16" not in chosen
    # Each load's first plan was held against the time its first token took, but the first load's: it chose
    # before any decode time was measured, so its plan was a guess.
    assert len(reader.kv_store.estimate.plan_errors) == len(PROMPTS) - 1
    assert all(error > 0 for error in reader.kv_store.estimate.plan_errors)
    assert reader.kv_store.estimate.overshoots  # and their last choices' plans, stretched, against it too
    # What followed each load besides its prefill (estimated at 1 s a token here, so nothing is left of it).
    assert reader.kv_store.estimate.after_load_seconds == 0.0
    reader.kv_store.estimate.prefill = PrefillSpeed(per_token=0.001)
    reader.kv_store.observe_after_load(0.5, PrefillWork(tokens=100, pairs=5000))
    assert reader.kv_store.estimate.after_load_seconds == pytest.approx(0.4)


def test_links_with_their_own_policies_take_turns_on_one_engine(tiny_llama, reference, redis_server):
    run_rounds(make_engine(tiny_llama, kv_store=redis_server.url, kv_store_format="levels"), rounds=1)
    reader = make_engine(tiny_llama, kv_store=redis_server.url, kv_store_format="levels")
    low, raw = (reader.make_kv_store_link(kv_store_level=level) for level in ("low", "float16"))
    assert (low.level, raw.level, reader.kv_store.level) == ("low", "float16", "auto")
    metrics = ServerMetrics("test-model", reader)
    outputs, scraped = {}, {}
    for name, link in (("low", low), ("float16", raw), ("no store", None)):
        reader.use_kv_store_link(link)
        reader.reset_prefix_cache()  # else the prompts are found in the device pool
        outputs[name] = run_rounds(reader, rounds=1)
        scraped[name] = metrics.render().decode()
    chunks = len(PROMPTS) * (199 // CHUNK)
    assert (low.stats.chunks_by_option, raw.stats.chunks_by_option) == ({"low": chunks}, {"float16": chunks})
    # /metrics tells the counters of the link in use when scraped
    streamed = 'kvstrata:kv_store_streamed_chunks_total{{level="{}",model_name="test-model"}} {}.0'
    assert streamed.format("low", chunks) in scraped["low"] and "float16" not in scraped["low"]
    assert streamed.format("float16", chunks) in scraped["float16"] and '"low"' not in scraped["float16"]
    assert "kvstrata:kv_store_" not in scraped["no store"]
    assert outputs["float16"] == outputs["no store"] == reference
    reader.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1))
    with pytest.raises(KvstrataError, match="only when no request is unfinished"):
        reader.use_kv_store_link(low)


def test_a_load_probes_the_link_before_choosing_its_first_chunk(tiny_llama, redis_server):
    run_rounds(make_engine(tiny_llama, kv_store=redis_server.url, kv_store_format="levels"), rounds=1)
    reader = make_engine(tiny_llama, kv_store=redis_server.url, kv_store_format="levels", ttft_slo=10.0,
                         kv_store_link_gbps="10")
    reader.kv_store.estimate.bytes_per_second = 1.0  # as a load over a dead-slow link left it
    reads = []
    original = reader.kv_store.store.read
    reader.kv_store.store.read = lambda where, level=None, layers=None: reads.append((level, layers)) or original(
        where, level, layers)
    run_rounds(reader, rounds=1)
    chunks = len(PROMPTS) * (199 // CHUNK)
    # Without the probe, the first chunk of each load would go at the quickest level for 1 byte/s.
    assert reader.kv_store.stats.chunks_by_option == {"float16": chunks}
    assert reader.kv_store.stats.chunks_below_allowed == 0
    # Each load: its first chunk's first two layers at float16 (the probe), then that chunk's last layer.
    probes = [read for read in reads if read[1] == range(2)]
    assert probes == [("float16", range(2))] * len(PROMPTS)
    assert reads.count(("float16", range(2, 3))) == len(PROMPTS)
    assert tier_hits(reader)["redis"] == chunks * CHUNK


def test_prefill_speed_tells_tokens_from_attention_pairs():
    assert PrefillWork.span(0, 3) == PrefillWork(3, 1 + 2 + 3)
    assert PrefillWork.span(100, 2) == PrefillWork(2, 101 + 102)
    # Steps alike (one context length): one scale, split as the prior says (a pair costs a tenth of a token).
    alike = PrefillSpeed(pair_cost_ratio=0.1)
    assert alike.seconds(PrefillWork(100, 0)) is None
    for _ in range(3):
        alike.observe(PrefillWork(100, 1000), 0.2)  # 100 + 0.1 * 1000 = 200 units in 0.2 s
    assert (alike.per_token, alike.per_pair) == (pytest.approx(1e-3), pytest.approx(1e-4))
    alike.observe(PrefillWork(10, 10), 5.0)  # too few tokens to tell anything
    assert alike.per_token == pytest.approx(1e-3)
    # Steps at different context lengths: both rates from the measurements, whatever the prior.
    spread = PrefillSpeed(pair_cost_ratio=0.1)
    for tokens, pairs in ((256, 256 * 129), (256, 256 * 3000), (512, 512 * 1000)):
        spread.observe(PrefillWork(tokens, pairs), tokens * 2e-3 + pairs * 1e-6)
    assert (spread.per_token, spread.per_pair) == (pytest.approx(2e-3), pytest.approx(1e-6))
    assert spread.seconds(PrefillWork.span(3000, 256)) > spread.seconds(PrefillWork.span(0, 256))


def test_streaming_options_are_checked(tiny_llama):
    with pytest.raises(KvstrataError, match="kv_store_level 'best'"):
        make_engine(tiny_llama, kv_store="host:1MiB", kv_store_level="best")
    with pytest.raises(KvstrataError, match="kv_store_link_gbps part 'fast'"):
        make_engine(tiny_llama, kv_store="host:1MiB", kv_store_link_gbps="fast")
    with pytest.raises(KvstrataError, match="ttft_slo must be a positive"):
        make_engine(tiny_llama, kv_store="host:1MiB", ttft_slo=-1.0)
