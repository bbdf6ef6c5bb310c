"""The KV store under a real engine (tiny model): outputs never depend on whether the store answered, hits
below the device pool replace prefill, and every failure of the store is absorbed."""

import random
import threading

import pytest
import torch

from kvstrata import LLM
from kvstrata.cachegen.profile import calibrate
from kvstrata.config import EngineConfig
from kvstrata.engine import llm_engine
from kvstrata.engine.direct_forward import compute_kv
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.errors import KvstrataError
from kvstrata.kv.store.errors import CorruptObject
from kvstrata.kv.store.forms import written_form
from kvstrata.kv.store.objects import unpack_object

CHUNK = 32
# Six 200-token prompts, asked twice: the device pool (480 KiB: 640 tokens, 3 prompts) cannot keep them all.
def random_prompt(seed: int, length: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 250) for _ in range(length)]


PROMPTS = [random_prompt(seed) for seed in range(6)]


def make_engine(model, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), kv_cache_memory="480KiB", threads=1,
                                  kv_store_chunk_tokens=CHUNK, **options))


def run_rounds(engine: LLMEngine, rounds: int = 2, between=None) -> dict[str, list[int]]:
    """Every prompt, `rounds` times; greedy; returns each request's output tokens (a failed one: its error)."""
    outputs = {}
    for round_index in range(rounds):
        for index, prompt in enumerate(PROMPTS):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=6), request_id=f"{round_index}-{index}")
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output.error or output.token_ids
        if engine.kv_store is not None:
            engine.kv_store.flush()
        if between is not None:
            between(round_index)
    return outputs


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return run_rounds(make_engine(tiny_llama))


def tier_hits(engine) -> dict[str, int]:
    return {tier.name: tier.stats.hit_tokens for tier in engine.kv_store.store.tiers}


@pytest.mark.parametrize("tiers", ["host:64MiB", "disk", "redis", "host:100KiB,disk"])
def test_greedy_outputs_equal_a_run_without_the_store(tiny_llama, reference, tmp_path, redis_server, tiers):
    spec = tiers.replace("disk", f"disk:{tmp_path}/kv:64MiB").replace("redis", redis_server.url)
    engine = make_engine(tiny_llama, kv_store=spec)
    assert run_rounds(engine) == reference
    assert engine.kv_store.stats.loaded_tokens > 0  # the second round found chunks below the device pool
    assert sum(tier_hits(engine).values()) == engine.kv_store.stats.loaded_tokens
    assert engine.kv_store.stats.load_failures == 0


def test_a_restarted_engine_finds_the_disk_tier_s_chunks(tiny_llama, reference, tmp_path):
    spec = f"disk:{tmp_path}/kv:64MiB"
    run_rounds(make_engine(tiny_llama, kv_store=spec), rounds=1)
    fresh = make_engine(tiny_llama, kv_store=spec)
    assert run_rounds(fresh, rounds=1) == {r: t for r, t in reference.items() if r.startswith("0-")}
    # Every prompt's 6 full chunks before its last token come from disk in a fresh engine.
    assert tier_hits(fresh) == {"disk": len(PROMPTS) * (199 // CHUNK) * CHUNK}


def test_closing_an_engine_finishes_its_queued_writes(tiny_llama, tmp_path):
    spec = f"disk:{tmp_path}/kv:64MiB"
    engine = make_engine(tiny_llama, kv_store=spec)
    for index, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2), request_id=str(index))
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()  # no flush: closing waits for the write thread
    fresh = make_engine(tiny_llama, kv_store=spec)
    assert fresh.kv_store.store.tiers[0].usage().chunks == 3 * (199 // CHUNK)


def test_engines_sharing_one_redis_share_chunks(tiny_llama, reference, redis_server):
    run_rounds(make_engine(tiny_llama, kv_store=redis_server.url), rounds=1)
    other = make_engine(tiny_llama, kv_store=f"host:64MiB,{redis_server.url}")
    assert run_rounds(other, rounds=1) == {r: t for r, t in reference.items() if r.startswith("0-")}
    assert tier_hits(other)["redis"] == len(PROMPTS) * (199 // CHUNK) * CHUNK


def test_a_dead_redis_loses_nothing(tiny_llama, reference, redis_server, caplog):
    url = redis_server.url
    redis_server.stop()
    with caplog.at_level("WARNING", logger="kvstrata.kv.store"):
        engine = make_engine(tiny_llama, kv_store=url, kv_store_timeout_ms=200)
    # said when the engine starts (a mistyped address too), before any prompt is long enough to look a chunk up
    assert f"redis tier {url}: PING failed" in caplog.text and "asked again every 2 s" in caplog.text
    assert run_rounds(engine) == reference
    assert engine.kv_store.stats.loaded_tokens == 0 and engine.kv_store.store.tiers[0].stats.errors > 0


def test_redis_killed_and_restarted_between_rounds_loses_nothing(tiny_llama, reference, redis_server):
    engine = make_engine(tiny_llama, kv_store=redis_server.url, kv_store_timeout_ms=200)
    engine.kv_store.store.tiers[0].retry_seconds = 0.0

    def restart(round_index):
        redis_server.stop()
        redis_server.start()  # empty: the second round recomputes what it would have loaded
    assert run_rounds(engine, rounds=3, between=restart) == {**reference, **{
        f"2-{i}": reference[f"1-{i}"] for i in range(len(PROMPTS))}}


def test_redis_killed_in_the_middle_of_a_load_loses_nothing(tiny_llama, reference, redis_server):
    engine = make_engine(tiny_llama, kv_store=redis_server.url, kv_store_timeout_ms=200)
    tier = engine.kv_store.store.tiers[0]
    real_get, calls = tier.get, []

    def get_then_die(key, names):
        calls.append(key)
        if len(calls) == 3:  # the third chunk fetched in the second round: the server is gone
            redis_server.stop()
        return real_get(key, names)

    tier.get = get_then_die
    assert run_rounds(engine) == reference
    assert engine.kv_store.stats.loaded_tokens == 2 * CHUNK and engine.kv_store.stats.load_failures == 1


def test_a_corrupt_chunk_is_dropped_and_recomputed(tiny_llama, reference, tmp_path):
    directory = tmp_path / "kv"
    engine = make_engine(tiny_llama, kv_store=f"disk:{directory}:64MiB")

    def corrupt_every_chunk(round_index):
        for path in directory.iterdir():
            data = bytearray(path.read_bytes())
            data[-10] ^= 0x55  # a byte of the last object's payload
            path.write_bytes(bytes(data))
    assert run_rounds(engine, between=corrupt_every_chunk) == reference
    assert engine.kv_store.store.stats.corrupt_objects > 0 and engine.kv_store.stats.load_failures > 0


def test_a_full_disk_skips_writes_and_serving_goes_on(tiny_llama, reference, tmp_path, monkeypatch):
    import errno
    import os

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    engine = make_engine(tiny_llama, kv_store=f"disk:{tmp_path}/kv:64MiB")
    assert run_rounds(engine) == reference
    assert engine.kv_store.store.tiers[0].stats.errors > 0 and engine.kv_store.stats.loaded_tokens == 0


def test_an_engine_reads_chunks_another_wrote_in_another_form(tiny_llama, redis_server):
    run_rounds(make_engine(tiny_llama, kv_store=redis_server.url, kv_store_format="medium"), rounds=1)
    reader = make_engine(tiny_llama, kv_store=f"host:64MiB,{redis_server.url}", kv_store_format="host=raw")
    run_rounds(reader, rounds=1)
    assert tier_hits(reader)["redis"] == len(PROMPTS) * (199 // CHUNK) * CHUNK
    assert reader.kv_store.store.stats.corrupt_objects == 0


def test_lossy_forms_serve_from_the_store(tiny_llama, tmp_path):
    for form in ("fp16", "medium"):
        engine = make_engine(tiny_llama, kv_store="host:64MiB", kv_store_format=form)
        outputs = run_rounds(engine)
        assert all(isinstance(tokens, list) and len(tokens) == 6 for tokens in outputs.values())
        assert engine.kv_store.stats.loaded_tokens > 0


def test_chunks_are_coded_over_components_at_their_positions(tiny_llama, emma_text, monkeypatch):
    """Where the model's profile holds transforms, the store's CacheGen objects are coded over them, each chunk at
    its position in the prompt (keys before RoPE), and such objects live in a namespace naming the profile."""
    calibrating = make_engine(tiny_llama)
    profile = calibrate(calibrating, calibrating.tokenize(emma_text[:20000]), windows=3, window_tokens=64,
                        progress=False, sensitivity_windows=2, sensitivity_context=48, sensitivity_scored=16)
    monkeypatch.setattr(llm_engine, "shipped_profile", lambda fingerprint: profile)
    engine = make_engine(tiny_llama, kv_store="host:64MiB", kv_store_format="high")
    assert engine.kv_store.store.shape.namespace.endswith(f"cachegen-{profile.digest}/")
    outputs = run_rounds(engine)
    assert all(isinstance(tokens, list) and len(tokens) == 6 for tokens in outputs.values())
    assert engine.kv_store.stats.loaded_tokens > 0 and engine.kv_store.store.stats.corrupt_objects == 0
    store, prompt = engine.kv_store.store, PROMPTS[0]
    k, v = compute_kv(engine, prompt)
    reader = written_form("high+transform", profile)
    for index, key in enumerate(engine.kv_store.chunk_keys(prompt, len(prompt) // CHUNK)):
        objects = store.read(store.find(key, CHUNK)).objects
        got_k, got_v, written, position = store._decode(key, objects, CHUNK)
        assert (written, position) == ({"high+transform"}, index * CHUNK)
        span = slice(index * CHUNK, (index + 1) * CHUNK)
        for got, exact in ((got_k, k[:, span]), (got_v, v[:, span])):
            assert (got - exact).pow(2).mean() < 0.05 * exact.pow(2).mean()
        # decoded as if it sat elsewhere, a key comes back turned by the wrong angles (only the first chunk has
        # an 8-bit anchor, so it reads at no other position)
        header, payload = unpack_object(objects["k.1"], store.shape.namespace, key, "k.1")
        if position == 0:
            with pytest.raises(CorruptObject, match="section holds"):
                reader.decode(payload, header.shape, "k", 1, store.shape.num_layers, 5)
            continue
        shifted = reader.decode(payload, header.shape, "k", 1, store.shape.num_layers, position + 5)
        assert (shifted - k[1, span]).pow(2).mean() > 5 * (got_k[1] - k[1, span]).pow(2).mean()


def test_the_store_s_threads_leave_the_engine_s_thread_count_alone(tiny_llama, tmp_path):
    """The decoder and write threads run torch on one thread each, as many decoders as the engine has threads;
    the engine's forward keeps its own count."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="480KiB", threads=2,
                                    kv_store_chunk_tokens=CHUNK, kv_store="host:64MiB", kv_store_format="medium"))
    run_rounds(engine)
    assert engine.kv_store.stats.loaded_tokens > 0 and torch.get_num_threads() == 2
    link = engine.kv_store
    counts = [thread.submit(torch.get_num_threads).result() for thread in (link._load_thread, link.writes._thread)]
    assert counts == [2, 1]
    both = threading.Barrier(2, timeout=10)  # each task waits for the other: they run on the two decoder threads
    decoders = [link._decoders.submit(lambda: (both.wait(), torch.get_num_threads())[1]) for _ in range(2)]
    assert [decoder.result() for decoder in decoders] == [1, 1] and link.estimate.decoders == 2
    # A thread that has run no torch op yet (the server's engine thread) steps the engine on the engine's count
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2))
    stepped = []
    thread = threading.Thread(target=lambda: stepped.append((engine.step(), torch.get_num_threads())[1]))
    thread.start()
    thread.join()
    assert stepped == [2]


def test_an_aborted_request_leaves_while_its_chunks_load(tiny_llama, tmp_path):
    run_rounds(make_engine(tiny_llama, kv_store=f"disk:{tmp_path}:64MiB"), rounds=1)
    engine = make_engine(tiny_llama, kv_store=f"disk:{tmp_path}:64MiB")  # its device pool is empty
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4), request_id="gone")
    assert engine.num_loading == 1
    assert engine.abort("gone").finish_reason == "abort"
    assert engine.num_loading == 0 and not engine.has_unfinished_requests()


def test_requests_with_one_prompt_share_one_load(tiny_llama, reference, tmp_path):
    store = f"disk:{tmp_path}:64MiB"
    run_rounds(make_engine(tiny_llama, kv_store=store), rounds=1)

    def load(copies: int):
        engine = make_engine(tiny_llama, kv_store=store)  # its device pool is empty
        ids = [engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6)) for _ in range(copies)]
        placed, check = [], engine._check_preloaded

        def placing(ranges, num_tokens, moved=None):
            placed.append(check(ranges, num_tokens, moved))
            return placed[-1]

        engine._check_preloaded = placing
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        assert len(placed) == copies and all(p[0] is placed[0][0] for p in placed)  # moved to the device once
        return [outputs[i] for i in ids], sum(tier.stats.bytes_read for tier in engine.kv_store.store.tiers)

    alone, bytes_alone = load(1)
    together, bytes_together = load(3)  # the `n` samples of one request, say
    assert alone == [reference["0-0"]] and together == alone * 3
    assert bytes_together == bytes_alone > 0
    engine = make_engine(tiny_llama, kv_store=store)
    engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=6), request_id="first")  # holds the thread
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4), request_id="gone")
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6), request_id="stays")
    engine.abort("gone")  # the load it shares, not begun yet, is not cancelled: the other waits on it
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    assert outputs == {"first": reference["0-1"], "stays": reference["0-0"]}
    assert engine.kv_store.stats.requests_loaded == 2


def test_requests_sharing_a_stored_prefix_read_it_once(tiny_llama, tmp_path):
    store = f"disk:{tmp_path}:64MiB"
    run_rounds(make_engine(tiny_llama, kv_store=store), rounds=1)  # PROMPTS[0]'s 6 chunks are stored
    # Three questions about one document: its 6 stored chunks, then 20 tokens of each question's own (less than a
    # chunk, so no run writes more chunks to the store).
    prompts = [PROMPTS[0][: 6 * CHUNK] + random_prompt(100 + i, 20) for i in range(3)]

    def run(prompts, abort_first=False, **options):
        engine = make_engine(tiny_llama, **options)
        if abort_first:  # its load, not begun yet, is cancelled: the requests sharing its prefix read it anew
            engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=6))  # holds the load thread
            engine.add_request(prompts[0], SamplingParams(max_tokens=4), request_id="gone")
            prompts = prompts[1:]
        ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=6)) for p in prompts]
        if abort_first:
            engine.abort("gone")
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.cached = [outputs[i].num_cached_tokens for i in ids]
        return [outputs[i].token_ids for i in ids], engine

    expected, _ = run(prompts)  # no store
    alone, engine = run(prompts[:1], kv_store=store)
    bytes_alone = engine.kv_store.store.tiers[0].stats.bytes_read
    together, engine = run(prompts, kv_store=store)
    assert alone == expected[:1] and together == expected
    assert engine.kv_store.store.tiers[0].stats.bytes_read == bytes_alone > 0  # the document's chunks read once
    assert engine.kv_store.stats.requests_loaded == 3 and engine.kv_store.stats.loaded_tokens == 3 * 6 * CHUNK
    # the first placed the store's KV on the device, the others found it there: reused by all three
    assert engine.cached == [6 * CHUNK, 6 * CHUNK, 6 * CHUNK]
    rest, engine = run(prompts, abort_first=True, kv_store=store)
    assert rest == expected[1:]
    assert engine.kv_store.store.tiers[0].stats.bytes_read == 2 * bytes_alone  # PROMPTS[1]'s, then the document's


def test_store_options_are_checked(tiny_llama):
    with pytest.raises(KvstrataError, match="kv_store part 'host:lots'"):
        make_engine(tiny_llama, kv_store="host:lots")
    with pytest.raises(KvstrataError, match="needs prefix caching"):
        make_engine(tiny_llama, kv_store="host:1MiB", enable_prefix_caching=False)
    with pytest.raises(KvstrataError, match="kv_store_format 'gzip'"):
        make_engine(tiny_llama, kv_store="host:1MiB", kv_store_format="gzip")
    with pytest.raises(KvstrataError, match="names the tiers \\['redis'\\]"):
        make_engine(tiny_llama, kv_store="host:1MiB", kv_store_format="redis=medium")


def test_the_server_reports_the_store_on_its_metrics(tiny_llama, tmp_path):
    import httpx

    from tests.server_harness import running_server

    spec = f"disk:{tmp_path}:64MiB"
    run_rounds(make_engine(tiny_llama, kv_store=spec), rounds=1)
    with running_server(str(tiny_llama), kv_cache_memory="480KiB", threads=1, kv_store_chunk_tokens=CHUNK,
                        kv_store=spec) as (base_url, _):
        reply = httpx.post(f"{base_url}/v1/completions", json={"model": "test-model", "prompt": PROMPTS[0],
                                                               "max_tokens": 2, "temperature": 0}, timeout=60)
        assert reply.status_code == 200
        metrics = httpx.get(f"{base_url}/metrics").text
    assert f'kvstrata:kv_store_hit_tokens_total{{model_name="test-model",tier="disk"}} {199 // CHUNK * CHUNK}.0' in metrics
    assert 'kvstrata:kv_store_errors_total{model_name="test-model",tier="disk"} 0.0' in metrics
    assert 'kvstrata:kv_store_corrupt_objects_total{model_name="test-model"} 0.0' in metrics


def test_the_store_command_shows_and_clears_a_store(tiny_llama, tmp_path, capsys):
    import json

    from kvstrata.cli.main import main

    spec = f"disk:{tmp_path}:64MiB"
    run_rounds(make_engine(tiny_llama, kv_store=spec), rounds=1)
    main(["kv", "store", "stats", "--kv-store", spec, "--json"])
    (disk,) = json.loads(capsys.readouterr().out)["tiers"]
    assert disk["tier"] == "disk" and disk["chunks"] == len(PROMPTS) * (200 // CHUNK) and disk["bytes"] > 0
    main(["kv", "store", "clear", "--kv-store", spec])
    assert capsys.readouterr().out == f"cleared disk:{tmp_path}:{64 * 2**20}\n"
    main(["kv", "store", "stats", "--kv-store", spec, "--json"])
    assert json.loads(capsys.readouterr().out)["tiers"][0]["chunks"] == 0


def test_kv_from_the_store_that_does_not_fit_is_prefilled_instead(tiny_llama, reference, tmp_path):
    import torch

    from kvstrata.kv.preloaded import PreloadedKV

    spec = f"disk:{tmp_path}:64MiB"
    run_rounds(make_engine(tiny_llama, kv_store=spec), rounds=1)
    engine = make_engine(tiny_llama, kv_store=spec)
    engine.kv_store._load = lambda seq, keys, first, sharing: [PreloadedKV(0, torch.zeros(1, CHUNK, 2, 16),
                                                                   torch.zeros(1, CHUNK, 2, 16))]
    misfits = []
    engine._check_preloaded = lambda ranges, num_tokens, moved=None, check=engine._check_preloaded: (
        misfits.extend(ranges) or check(ranges, num_tokens, moved))
    assert run_rounds(engine, rounds=1) == {r: t for r, t in reference.items() if r.startswith("0-")}
    assert len(misfits) == len(PROMPTS)  # every request was handed the misfit, and prefilled instead


def test_a_full_write_backlog_writes_the_chunks_that_fit(tiny_llama, tmp_path, monkeypatch):
    from kvstrata.engine import kv_store_writes

    chunk_bytes = 2 * 3 * CHUNK * 2 * 16 * 4  # layers x tokens x kv heads x head dim, float32 K and V
    monkeypatch.setattr(kv_store_writes, "MAX_PENDING_WRITE_BYTES", 2 * chunk_bytes)
    engine = make_engine(tiny_llama, kv_store=f"disk:{tmp_path}:64MiB")
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_store.flush()
    assert engine.kv_store.stats.chunks_queued == 2 and engine.kv_store.stats.writes_skipped == 200 // CHUNK - 2
    assert engine.kv_store.store.tiers[0].usage().chunks == 2


def test_a_store_under_int4_weights_costs_prefill_like_float_weights(tiny_llama):
    """The link's prefill model counts the weights a token is multiplied by; int4 weights are packed buffers, not
    parameters, and were once counted as none (a division by zero at start-up with the default weights)."""
    ratios = {}
    for weights in ("fp32", "int4"):
        engine = make_engine(tiny_llama, weights=weights, kv_store="host:8MiB")
        ratios[weights] = engine.kv_store.estimate.prefill.pair_cost_ratio
        engine.kv_store.close()
    assert ratios["int4"] == ratios["fp32"] > 0


def test_requests_on_a_saved_context_neither_look_up_nor_write_chunks(tiny_llama, tmp_path):
    """Their KV is the context's decoded bitstream, not what a prefill computes: it is kept out of the store."""
    llm = LLM(str(tiny_llama), kv_cache_memory="480KiB", threads=1, kv_store_chunk_tokens=CHUNK,
              kv_store=f"disk:{tmp_path}/kv:64MiB")
    llm.save_context(PROMPTS[0], tmp_path / "context.kv", levels=["near-lossless"])
    llm.generate([PROMPTS[1][:80]], SamplingParams(temperature=0, max_tokens=2), context=tmp_path / "context.kv")
    llm.engine.kv_store.flush()
    assert llm.engine.kv_store.stats.requests_looked_up == 0 and llm.engine.kv_store.stats.chunks_queued == 0
    llm.generate([PROMPTS[1][:80]], SamplingParams(temperature=0, max_tokens=2))  # the control: a plain request
    llm.engine.kv_store.flush()
    assert llm.engine.kv_store.stats.requests_looked_up == 1 and llm.engine.kv_store.stats.chunks_queued == 2
