"""Saved contexts in the engine: decoded chunks replace the context's prefill, text chunks are recomputed."""

import json

import pytest
import torch

from kvstrata import LLM, SamplingParams
from kvstrata.cachegen.codec import decode_tensor, encode_tensor
from kvstrata.cachegen.context import SavedContext
from kvstrata.cachegen.errors import ForeignModelError
from kvstrata.cachegen.levels import TRANSFORM_LEVELS
from kvstrata.cachegen.profile import CodecProfile, calibrate
from kvstrata.cachegen.token_importance import observed_importance, token_codes
from kvstrata.cli.main import main
from kvstrata.engine.direct_forward import compute_kv
from kvstrata.errors import KvstrataError
from kvstrata.kv.preloaded import PreloadedKV

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory="8MiB", threads=1)


@pytest.fixture(scope="module")
def context_ids(llm, emma_text):
    return llm.engine.tokenize(emma_text[5000:9000])[:95]


@pytest.fixture(scope="module")
def question(llm):
    return llm.engine.tokenize(" What did she say?")


def prefilled_tokens(llm) -> int:
    return sum(s.prefill_tokens for s in llm.engine.step_stats)


def generate(llm, prompt, **context):
    llm.engine.step_stats.clear()
    return llm.generate(prompt, GREEDY, **context)[0]


def test_exact_preloaded_kv_reproduces_plain_generation(llm, context_ids, question):
    plain = generate(llm, context_ids + question)
    k, v = compute_kv(llm.engine, context_ids)
    request = llm.engine.add_request(
        context_ids + question, GREEDY, preloaded=[PreloadedKV(0, k, v)], cache_salt=b"exact"
    )
    llm.engine.step_stats.clear()
    output = llm._run_to_completion([request], False)[0]
    assert output.token_ids == plain.token_ids
    assert prefilled_tokens(llm) == len(question)


@pytest.mark.parametrize("chunk_tokens", [95, 30, 10])
def test_saved_context_skips_prefill_and_matches(llm, context_ids, question, tmp_path, chunk_tokens):
    """Resuming places exactly the decoded KV: the output equals a request given that KV directly. (Equality
    with the uncompressed cache is tested on the real model: this random model's top logits are often within
    0.01 of each other, so any lossy cache may flip a tie.)"""
    path = tmp_path / "context.kv"
    llm.save_context(context_ids, path, levels=["near-lossless"], chunk_tokens=chunk_tokens)
    resumed = generate(llm, question, context=path)
    assert prefilled_tokens(llm) == len(question)
    decoded = SavedContext(llm.engine, path).preloaded()
    assert [p.start for p in decoded] == list(range(0, len(context_ids), chunk_tokens))
    request = llm.engine.add_request(context_ids + question, GREEDY, preloaded=decoded, cache_salt=path.read_bytes())
    assert resumed.token_ids == llm._run_to_completion([request], False)[0].token_ids


@pytest.mark.parametrize("scheduler", ["sarathi", "prefill-first", "static"])
def test_text_chunks_are_recomputed_on_the_decoded_ones(tiny_llama, context_ids, question, tmp_path, scheduler):
    """Chunks 1 and 3 given as text are prefilled on top of the decoded chunks 0 and 2, at the right
    positions: the output equals one request that prefills the whole context with only those chunks' KV."""
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB", threads=1, scheduler=scheduler, chunk_size=64)
    path = tmp_path / "context.kv"
    llm.save_context(context_ids, path, levels=["near-lossless"], chunk_tokens=30)  # chunks of 30, 30, 30, 5
    resumed = generate(llm, question, context=path, recompute_chunks=[1, 3])
    assert prefilled_tokens(llm) == 30 + 5 + len(question)
    assert resumed.num_cached_tokens == 30 + 30  # chunks 0 and 2, placed before and after chunk 1 is computed
    decoded = SavedContext(llm.engine, path).preloaded(recompute={1, 3})
    assert [p.start for p in decoded] == [0, 60]
    request = llm.engine.add_request(context_ids + question, GREEDY, preloaded=decoded, cache_salt=b"mixed")
    assert resumed.token_ids == llm._run_to_completion([request], False)[0].token_ids


def test_decoded_blocks_are_not_shared_with_plain_prompts(tiny_llama, context_ids, question, tmp_path):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB", threads=1)  # a prefix cache no other test filled
    path = tmp_path / "context.kv"
    llm.save_context(context_ids, path, levels=["low"], chunk_tokens=95)
    generate(llm, question, context=path)
    again = generate(llm, question, context=path)  # the same load shares the first one's blocks
    assert again.num_cached_tokens > 0 and prefilled_tokens(llm) < len(question)
    plain = generate(llm, context_ids + question)  # must not reuse the lossy blocks
    assert plain.num_cached_tokens == 0 and prefilled_tokens(llm) == len(context_ids + question)


def test_a_context_from_another_model_is_refused(llm, tiny_llama_tied, context_ids, tmp_path):
    path = tmp_path / "context.kv"
    llm.save_context(context_ids, path, levels=["medium"])
    other = LLM(str(tiny_llama_tied), kv_cache_memory="8MiB", threads=1)
    with pytest.raises(ForeignModelError, match="model"):
        other.generate("hello", GREEDY, context=path)


def test_bad_load_requests_name_the_problem(llm, context_ids, tmp_path):
    path = tmp_path / "context.kv"
    llm.save_context(context_ids, path, levels=["medium"], chunk_tokens=50)
    with pytest.raises(KvstrataError, match="level 'high'"):
        llm.generate("x", GREEDY, context=path, context_level="high")
    with pytest.raises(KvstrataError, match=r"recompute chunks \[7\]"):
        llm.generate("x", GREEDY, context=path, recompute_chunks=[7])
    with pytest.raises(KvstrataError, match="chunk_tokens"):
        llm.save_context(context_ids, path, chunk_tokens=3)
    with pytest.raises(KvstrataError, match="cannot read"):
        llm.generate("x", GREEDY, context=tmp_path / "missing.kv")


def test_profiled_levels_need_their_profile(llm, context_ids, emma_text, tmp_path):
    token_ids = llm.engine.tokenize(emma_text[:20000])
    profile = calibrate(llm.engine, token_ids, windows=3, window_tokens=64, progress=False, sensitivity_windows=2,
                        sensitivity_context=48, sensitivity_scored=16)
    profile.save(tmp_path / "profile.npz")
    loaded = CodecProfile.load(tmp_path / "profile.npz", llm.engine.model_fingerprint)
    assert loaded.digest == profile.digest
    config = llm.engine.loaded.config
    for kind in (loaded.k, loaded.v):
        assert kind.sensitivity.shape == (config.num_layers, config.num_kv_heads * config.head_dim)
        assert (kind.sensitivity > 0).all() and kind.sigma.shape == (config.num_layers,) and (kind.sigma > 0).all()
    with pytest.raises(ForeignModelError):
        CodecProfile.load(tmp_path / "profile.npz", "0000000000000000")
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes((tmp_path / "profile.npz").read_bytes()[:500])
    with pytest.raises(KvstrataError, match="not a CacheGen profile"):
        CodecProfile.load(truncated, llm.engine.model_fingerprint)
    llm.save_context(context_ids, tmp_path / "p.kv", levels=["high"], chunk_tokens=50, profile=profile)
    with pytest.raises(KvstrataError, match="profile"):
        SavedContext(llm.engine, tmp_path / "p.kv")
    saved = SavedContext(llm.engine, tmp_path / "p.kv", profile=loaded)
    settings = saved.file.record(0, "high").settings
    assert settings == TRANSFORM_LEVELS["high"]
    # What was written: steps from the profile's sensitivity and the tokens' importance over the whole context,
    # over the components of the profile's transforms.
    k, v = compute_kv(llm.engine, context_ids)
    importance = observed_importance(llm.engine, context_ids, k, v)
    for kind, exact, decoded in zip(("k", "v"), (k, v), saved.decode_chunk(0)):
        flat = exact[:, :50].reshape(exact.shape[0], 50, -1)
        sections = encode_tensor(flat, settings, kind, getattr(loaded, kind),
                                 token_codes=token_codes(importance, kind)[:, :50])
        expected = decode_tensor(sections, settings, tuple(flat.shape), kind, getattr(loaded, kind))
        assert torch.equal(decoded, expected.reshape(decoded.shape))


def test_cli_save_inspect_generate(tiny_llama, tmp_path, capsys, emma_text):
    text = tmp_path / "context.txt"
    text.write_text(emma_text[:3000])
    out = tmp_path / "context.kv"
    engine = ["--model", str(tiny_llama), "--kv-cache-memory", "8MiB", "--threads", "1"]
    assert main(["kv", "save", "--text", str(text), "--out", str(out), "--levels", "high,uniform8",
                 "--chunk-tokens", "64", "--max-context-tokens", "150", *engine]) == 0
    capsys.readouterr()
    assert main(["kv", "inspect", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["levels"]) == {"high", "uniform8"} and report["num_tokens"] == 150
    for level in report["levels"].values():
        assert level["bits_per_value"] > 0 and level["bytes"] > 0
    assert report["levels"]["uniform8"]["bits_per_value"] > 8  # eight bits plus a scale per token
    assert main(["generate", "Then", "--context", str(out), "--context-level", "uniform8", "--max-tokens", "5",
                 *engine]) == 0
    assert main(["kv", "inspect", str(tmp_path / "context.txt")]) == 2
    assert "not a kvstrata KV file" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_opt"])
def test_transform_coded_chunks_are_coded_at_their_positions(model, emma_text, tmp_path, request):
    """Keys are coded before RoPE where the model has it (OPT has none), each chunk at its own position in the
    context: every chunk of a saved context decodes to what coding it alone at that position gives."""
    llm = LLM(str(request.getfixturevalue(model)), kv_cache_memory="8MiB", threads=1)
    token_ids = llm.engine.tokenize(emma_text[:20000])
    profile = calibrate(llm.engine, token_ids, windows=3, window_tokens=64, progress=False, sensitivity_windows=2,
                        sensitivity_context=48, sensitivity_scored=16)
    rotary = model == "tiny_llama"
    assert (profile.k.transform.inverse_frequencies is not None) == rotary
    assert profile.v.transform.inverse_frequencies is None
    context = token_ids[1000:1150]
    llm.save_context(context, tmp_path / "c.kv", levels=["high"], chunk_tokens=50, profile=profile)
    saved = SavedContext(llm.engine, tmp_path / "c.kv", profile=profile)
    k, v = compute_kv(llm.engine, context)
    importance = observed_importance(llm.engine, context, k, v)
    for chunk, (first, end) in enumerate(saved.chunk_bounds):
        settings = saved.file.record(chunk, "high").settings
        assert settings == TRANSFORM_LEVELS["high"]
        for kind, exact, decoded in zip(("k", "v"), (k, v), saved.decode_chunk(chunk)):
            flat = exact[:, first:end].reshape(exact.shape[0], end - first, -1)
            sections = encode_tensor(flat, settings, kind, getattr(profile, kind),
                                     token_codes=token_codes(importance, kind)[:, first:end], first_position=first)
            expected = decode_tensor(sections, settings, tuple(flat.shape), kind, getattr(profile, kind), first)
            assert torch.equal(decoded, expected.reshape(decoded.shape))
            elsewhere = decode_tensor(sections, settings, tuple(flat.shape), kind, getattr(profile, kind), first + 7)
            assert torch.equal(elsewhere, expected) == (kind == "v" or not rotary)
