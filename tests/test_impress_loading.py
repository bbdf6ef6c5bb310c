"""`--prefix-loading impress|h2o-keys` under a real engine (tiny model): a stored prefix is read layer by layer,
only what each layer chose; the request's tokens then attend to exactly what a reference over the whole prefix
K/V with the same choice attends to, in its prefill and in every decode; bytes are counted as read."""

import pytest
import torch

from kvstrata.config import EngineConfig
from kvstrata.engine.direct_forward import compute_kv
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.errors import KvstrataError
from kvstrata.kv.context_attention import AttendOverContext
from kvstrata.kv.impress.prefix_selection import PrefixSelector
from kvstrata.kv.store.disk_tier import chunk_file_bytes, read_chunk_file
from kvstrata.kv.store.tiered_store import probe_name
from tests.test_kv_store_engine import CHUNK, PROMPTS, make_engine, run_rounds


def disk(tmp_path) -> str:
    return f"disk:{tmp_path}/kv:64MiB"


def stored_then_loaded(model, tmp_path, writer: dict, reader: dict) -> tuple[LLMEngine, dict]:
    """One round in an engine that stores every prompt on disk, then one in a fresh engine that finds them all there
    (nothing in its device pool): the fresh engine and its outputs."""
    run_rounds(make_engine(model, kv_store=disk(tmp_path), **writer), rounds=1)
    fresh = make_engine(model, kv_store=disk(tmp_path), **reader)
    return fresh, run_rounds(fresh, rounds=1)


@pytest.fixture(scope="module")
def first_round(tiny_llama):
    return run_rounds(make_engine(tiny_llama), rounds=1)


@pytest.mark.parametrize("method", ["impress", "h2o-keys"])
def test_a_ratio_of_one_gives_the_full_load_s_greedy_output(tiny_llama, tmp_path, first_round, method):
    options = {"prefix_loading": method, "impress_ratio": 1.0}
    engine, outputs = stored_then_loaded(tiny_llama, tmp_path, options, options)
    assert outputs == first_round
    assert engine.kv_store.important_stats.loads == len(PROMPTS)
    assert engine.kv_store.important_stats.tokens_read == engine.kv_store.important_stats.tokens_offered


@pytest.mark.parametrize("method,rule,attend,ratio", [
    ("impress", "vote", "chosen", 0.3), ("impress", "union", "chosen", 0.3), ("h2o-keys", "vote", "chosen", 0.3),
    # attending every token read: a smaller share, so that some layer still leaves a chunk unread
    ("impress", "vote", "read", 0.05), ("impress", "chunks", "read", 0.3), ("h2o-keys", "vote", "read", 0.05)])
def test_the_request_attends_to_what_its_layers_chose_in_prefill_and_decode(tiny_llama, tmp_path, method, rule,
                                                                             attend, ratio):
    """The engine's greedy tokens after a partial load equal a reference's: the new tokens over the whole prefix's
    K/V, each layer reading only the tokens a selector over the whole keys chooses from the prompt's new tokens
    (with "read", those and the rest of their stored chunks)."""
    options = {"prefix_loading": method, "impress_ratio": ratio, "impress_rule": rule, "impress_attend": attend}
    engine, outputs = stored_then_loaded(tiny_llama, tmp_path, options, options)
    stats = engine.kv_store.important_stats
    assert stats.loads == len(PROMPTS) and stats.tokens_read < stats.tokens_offered
    # the chunks rule chooses whole chunks: nothing to add to them
    assert (stats.tokens_read > stats.tokens_chosen) == (attend == "read" and rule != "chunks")
    model = engine.runner.model
    prefix = (len(PROMPTS[0]) - 1) // CHUNK * CHUNK
    chunks = [torch.arange(prefix) // CHUNK] * model.config.num_layers
    partial = 0
    for index, prompt in enumerate(PROMPTS):
        generated = outputs[f"0-{index}"]
        k, v = compute_kv(engine, prompt[:prefix])
        new = prompt[prefix:] + generated[:-1]
        selector = PrefixSelector(list(k), method, ratio, len(prompt) - prefix, rule=rule, read_units=chunks,
                                  attend=attend)
        with torch.inference_mode():
            hidden = model(torch.tensor(new), torch.arange(prefix, prefix + len(new)),
                           AttendOverContext(list(k), list(v), selector), None)
            predicted = model.compute_logits(hidden)[len(prompt) - prefix - 1 :].argmax(-1).tolist()
        assert predicted == generated
        partial += sum(not d.tokens.all() for d in selector.decisions.values())
    assert partial > 0  # some layer of some request read a strict subset


@pytest.mark.parametrize("method", ["impress", "h2o-keys"])
def test_counted_bytes_are_the_bytes_read(tiny_llama, tmp_path, method):
    options = {"prefix_loading": method, "impress_ratio": 0.3}
    engine, _ = stored_then_loaded(tiny_llama, tmp_path, options, options)
    stats = engine.kv_store.important_stats
    assert stats.bytes_read == sum(tier.stats.bytes_read for tier in engine.kv_store.store.tiers) > 0
    layers = engine.loaded.config.num_layers
    assert 0 < stats.chunk_reads <= len(PROMPTS) * layers * (len(PROMPTS[0]) - 1) // CHUNK


def test_chunks_without_probe_keys_are_not_found_by_impress_nor_harmed(tiny_llama, tmp_path, first_round):
    engine, outputs = stored_then_loaded(tiny_llama, tmp_path, {}, {"prefix_loading": "impress"})
    assert outputs == first_round
    assert (engine.kv_store.stats.requests_loaded, engine.kv_store.stats.load_failures) == (0, 0)
    whole = make_engine(tiny_llama, kv_store=disk(tmp_path))  # the chunks written without probe keys are still there
    assert run_rounds(whole, rounds=1) == first_round
    assert whole.kv_store.stats.requests_loaded == len(PROMPTS)


def test_a_corrupt_probe_key_fails_that_load_alone_and_drops_its_chunk(tiny_llama, tmp_path, first_round):
    """The probe keys of every layer are read in one go and decoded layer by layer: one altered in the last layer
    still drops its chunk, and the request is recomputed from its text, equal to the first round."""
    options = {"prefix_loading": "impress", "impress_ratio": 0.3}
    run_rounds(make_engine(tiny_llama, kv_store=disk(tmp_path), **options), rounds=1)
    fresh = make_engine(tiny_llama, kv_store=disk(tmp_path), **options)
    path = min((tmp_path / "kv").glob("*.kvc"))
    objects = read_chunk_file(path, None)
    late = probe_name(fresh.loaded.config.num_layers - 1)
    whole = objects[late]
    objects[late] = whole[:-1] + bytes([whole[-1] ^ 1])
    path.write_bytes(chunk_file_bytes(objects))
    assert run_rounds(fresh, rounds=1) == first_round
    assert fresh.kv_store.store.stats.corrupt_objects == 1 and fresh.kv_store.stats.load_failures == 1
    fresh.kv_store.flush()
    assert read_chunk_file(path, [late])[late] == whole  # dropped, then stored again from the recomputed prompt


def test_a_reused_block_keeps_its_unread_tokens_and_a_new_one_does_not(tiny_llama, tmp_path):
    """Requests over the same prompts again, found in the device pool this time, read what the first ones' loads
    chose (same outputs, no new load); once the blocks are handed out for new content, no mask is left."""
    options = {"prefix_loading": "impress", "impress_ratio": 0.3, "impress_attend": "chosen"}
    run_rounds(make_engine(tiny_llama, kv_store=disk(tmp_path), **options), rounds=1)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="4MiB", threads=1, kv_store=disk(tmp_path),
                                    kv_store_chunk_tokens=CHUNK, **options))
    outputs = run_rounds(engine, rounds=2)
    first = {r[2:]: t for r, t in outputs.items() if r.startswith("0-")}
    again = {r[2:]: t for r, t in outputs.items() if r.startswith("1-")}
    assert again == first
    assert engine.kv_store.important_stats.loads == len(PROMPTS)
    policy = engine.attention
    assert policy.blocks_with_unread
    policy.reset_blocks(list(range(engine.kv_manager.pool.num_blocks)))
    assert not policy.blocks_with_unread and not policy.unread.any()


def test_the_server_reports_fallbacks_bytes_and_chunks_read(tiny_llama, tmp_path):
    import httpx

    from tests.server_harness import running_server

    options = {"prefix_loading": "impress", "impress_ratio": 0.3}
    run_rounds(make_engine(tiny_llama, kv_store=disk(tmp_path), **options), rounds=1)
    with running_server(str(tiny_llama), kv_cache_memory="480KiB", threads=1, kv_store_chunk_tokens=CHUNK,
                        kv_store=disk(tmp_path), **options) as (base_url, _):
        reply = httpx.post(f"{base_url}/v1/completions", json={"model": "test-model", "prompt": PROMPTS[0],
                                                               "max_tokens": 2, "temperature": 0}, timeout=60)
        assert reply.status_code == 200
        metrics = httpx.get(f"{base_url}/metrics").text
    labels = '{method="impress",model_name="test-model"}'
    assert f"kvstrata:prefix_loading_loads_total{labels} 1.0" in metrics
    layers = 3
    assert f"kvstrata:prefix_loading_layers_total{labels} {layers}.0" in metrics
    for name in ("fallbacks", "read_bytes", "chunk_reads", "chosen_tokens", "attended_tokens"):
        assert f"kvstrata:prefix_loading_{name}_total{labels}" in metrics


@pytest.mark.parametrize("options,message", [
    ({"prefix_loading": "impress"}, "kv_store"),
    ({"prefix_loading": "h2o-keys", "kv_store": "host:1MiB", "kv_offload": "h2o"}, "kv_offload none"),
    ({"prefix_loading": "impress", "kv_store": "host:1MiB", "kv_store_format": "host=levels"}, "without levels"),
    ({"prefix_loading": "impress", "kv_store": "host:1MiB", "compile": True}, "no compile"),
    ({"prefix_loading": "impress", "kv_store": "host:1MiB", "impress_ratio": 1.5}, "impress_ratio 1.5"),
    ({"prefix_loading": "some"}, "prefix_loading 'some' is not one of full, impress, h2o-keys"),
    ({"impress_rule": "majority"}, "impress_rule 'majority'"),
    ({"impress_attend": "all"}, "impress_attend 'all' is not one of read, chosen"),
])
def test_bad_prefix_loading_options_are_named(options, message):
    with pytest.raises(KvstrataError, match=message):
        EngineConfig(**options)
