"""Sliding-window models (Mistral v0.1, Phi-3-mini-4k) served past their window: each query reads the keys of its
last `window` positions, in prompt chunks, decodes and rows verifying drafts, as transformers masks them; steps
within the window run as full attention; the blocks behind the window go back to the pool, changing no output; policies
that choose keys themselves are refused past the window."""

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from kvstrata import LLM, SamplingParams
from kvstrata.bench.workload import run_together
from kvstrata.engine.direct_forward import compute_kv
from kvstrata.errors import KvstrataError
from kvstrata.eval.cache_scorer import CacheScorer
from kvstrata.kv.attention_policy import FullAttention
from kvstrata.kv.block_hash import full_block_hashes
from kvstrata.kv.formats.oaken.thresholds import DEFAULT_RATIOS
from kvstrata.kv.formats.oaken.thresholds import calibrate as calibrate_oaken
from kvstrata.kv.preloaded import PreloadedKV
from kvstrata.kv.sliding_window import SlidingWindowAttention
from tests.helpers import hf_greedy, hf_logits, prefill_in_chunks, use_policy
from tests.tiny_models import VOCAB_SIZE, save_tiny_checkpoint, tiny_phi3_config

pytestmark = pytest.mark.slow

WINDOW = 16
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["mistral", "phi3"])
def windowed(request, tmp_path_factory):
    """A tiny Mistral and a tiny Phi-3, each with a window of 16 tokens."""
    if request.param == "mistral":
        config = MistralConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                               sliding_window=WINDOW, bos_token_id=1, eos_token_id=2)
    else:
        config = tiny_phi3_config(sliding_window=WINDOW)
    return save_tiny_checkpoint(config, tmp_path_factory.mktemp(request.param), seed=12)


def prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(3, VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prompt_chunks_past_the_window_give_transformers_logits(windowed):
    llm = LLM(str(windowed), kv_cache_memory="8MiB")
    assert isinstance(llm.engine.attention, SlidingWindowAttention)
    ids = prompt(70)
    ours, _ = prefill_in_chunks(llm.engine, ids, chunk=24)
    theirs = hf_logits(AutoModelForCausalLM.from_pretrained(str(windowed)), ids)
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0)


def test_decodes_past_the_window_give_transformers_greedy_output(windowed):
    """Prompts shorter and longer than the window, decoded together past it."""
    reference = AutoModelForCausalLM.from_pretrained(str(windowed))
    prompts = [prompt(n, seed=n) for n in (5, 12, 40)]
    outs = LLM(str(windowed), kv_cache_memory="8MiB").generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(reference, p, GREEDY.max_tokens) for p in prompts]


def test_a_step_of_decodes_past_the_window_stays_one_operator_per_layer(windowed, monkeypatch):
    """Past the window, a step of decodes alone still takes the fused path (kv/fused_decode.py), given the window;
    within it, without one (the test above checks the tokens)."""
    engine = LLM(str(windowed), kv_cache_memory="8MiB").engine
    policy, windows = engine.attention, []

    def fused_decode(batch, dtype):
        fused = SlidingWindowAttention.fused_decode(policy, batch, dtype)
        windows.append(None if fused is None else fused.window)
        return fused

    monkeypatch.setattr(policy, "fused_decode", fused_decode)
    run_with_peak_blocks(engine, [prompt(8)], GREEDY)
    assert windows == [None] + [0] * 8 + [WINDOW] * 7  # the prompt; decodes at positions 8-15, then 16-22


def test_the_window_hides_what_full_attention_would_read(windowed):
    """The same model with the window taken away (full attention over every key) gives other logits past the
    window and the same ones within it: the test above could fail."""
    ids = prompt(40)
    windowed_logits, _ = prefill_in_chunks(LLM(str(windowed), kv_cache_memory="8MiB").engine, ids, chunk=40)
    full = LLM(str(windowed), kv_cache_memory="8MiB").engine
    use_policy(full, FullAttention(full.kv_cache))
    full_logits, _ = prefill_in_chunks(full, ids, chunk=40)
    assert torch.allclose(windowed_logits[:WINDOW], full_logits[:WINDOW], atol=1e-5)
    assert not torch.allclose(windowed_logits[WINDOW:], full_logits[WINDOW:], atol=1e-2)


@pytest.mark.parametrize("kv_format", ["int8", "int8/int4", "kivi4"])
def test_every_format_reads_the_window_alike_in_decodes_and_prompt_chunks(windowed, kv_format):
    """One token a step, each a decode past the window (only the window's keys gathered, decoded by the format),
    gives the logits of one prompt chunk (every key, the window masked) and of chunks of 24 (the second reads its
    keys from its first query's window on). int8's paths differ by 3e-3 on this model within the window too (the
    chunk's own keys), hence the tolerance; a key read outside the window moves a logit by 1e-1 and more (the test
    above)."""
    assert_chunks_read_the_window_alike(windowed, kv_format=kv_format)


def assert_chunks_read_the_window_alike(model, **options):
    def logits(chunk: int) -> torch.Tensor:
        llm = LLM(str(model), kv_cache_memory="16MiB", max_num_seqs=4, **options)
        return prefill_in_chunks(llm.engine, prompt(40), chunk=chunk)[0]

    one_by_one = logits(1)
    assert torch.allclose(one_by_one, logits(40), atol=5e-3, rtol=0)
    assert torch.allclose(one_by_one, logits(24), atol=5e-3, rtol=0)


def test_oaken_reads_a_chunk_s_keys_past_the_window_at_their_own_positions(tmp_path_factory):
    """Oaken decodes a key with the mean key rotated to its position, so a chunk that reads its keys from its first
    query's window on must decode them where they are, not at their column (a tiny Mistral whose token holds 64
    values, as Oaken's groups need; thresholds calibrated on random tokens)."""
    config = MistralConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                           sliding_window=WINDOW, bos_token_id=1, eos_token_id=2)
    model = save_tiny_checkpoint(config, tmp_path_factory.mktemp("mistral-kv64"), seed=12)
    engine = LLM(str(model), kv_cache_memory="8MiB").engine
    [thresholds] = calibrate_oaken(engine, prompt(400, seed=1), [DEFAULT_RATIOS], 3, 48, progress=False,
                                   source="random")
    path = tmp_path_factory.mktemp("oaken") / "thresholds.json"
    thresholds.save(path)
    assert_chunks_read_the_window_alike(model, kv_format="oaken", oaken_calibration=str(path))


def test_speculative_drafts_past_the_window_keep_the_greedy_output(windowed):
    """Rows verifying drafts read their window too: prompt-lookup drafts on a repetitive prompt past the window give
    the output without drafts."""
    ids = prompt(10) * 5
    plain = LLM(str(windowed), kv_cache_memory="8MiB").generate([ids], GREEDY)[0]
    drafting = LLM(str(windowed), kv_cache_memory="8MiB", num_speculative_tokens=3).generate([ids], GREEDY)[0]
    assert drafting.token_ids == plain.token_ids


def float32_pool_bytes(windowed, blocks: int) -> int:
    """The KV budget of a float32 pool of `blocks` blocks of 16 tokens."""
    c = LLM(str(windowed), kv_cache_memory="8MiB").engine.loaded.config
    return blocks * 16 * 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4


def run_with_peak_blocks(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list, int]:
    """The final outputs of `prompts` run together, and the most blocks the pool had in use after a step."""
    peak, step = 0, engine.step

    def step_and_count():
        nonlocal peak
        outputs = step()
        peak = max(peak, engine.kv_manager.pool.num_used)
        return outputs

    engine.step = step_and_count  # an instance attribute over the method, for this run only
    try:
        return run_together(engine, prompts, [params] * len(prompts)), peak
    finally:
        del engine.step


def test_blocks_behind_the_window_go_back_to_the_pool(windowed):
    """Past the window a sequence keeps only the blocks its next query reads: 40 + 60 tokens in blocks of 16 hold
    at most 2 blocks after each step (7 without giving any back), with transformers' greedy output. The blocks
    given back stay in the prefix cache: the same prompt again reads them."""
    engine = LLM(str(windowed), kv_cache_memory="8MiB").engine
    ids = prompt(40)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    [out], peak = run_with_peak_blocks(engine, [ids], params)
    assert out.token_ids == hf_greedy(AutoModelForCausalLM.from_pretrained(str(windowed)), ids, 60)
    assert peak == 2 and engine.kv_manager.pool.num_used == 0
    [again], _ = run_with_peak_blocks(engine, [ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert again.num_cached_tokens == 32 and again.token_ids == out.token_ids[:4]


@pytest.mark.parametrize("options", [{"kv_format": "fp32"}, {"kv_format": "int8/int4"},
                                     {"kv_format": "kivi4", "kivi_residual": 16}])
def test_giving_blocks_back_changes_no_output(windowed, options):
    """Prompts shorter and longer than the window, decoded together far past it (prompt chunks of 24, so a prompt's
    later chunks run after blocks were given back), give the same tokens as when every block is kept, in fewer
    blocks. KIVI's full-precision residual as long as the window: the first block kept (which the entries given
    back repeat) leaves it no sooner."""
    prompts = [prompt(n, seed=n) for n in (5, 30, 70)]
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)

    def run(give_back: bool):
        engine = LLM(str(windowed), kv_cache_memory="16MiB", chunk_size=24, **options).engine
        if not give_back:
            engine.kv_manager.window = None
        return run_with_peak_blocks(engine, prompts, params)

    (kept, peak_kept), (given_back, peak) = run(False), run(True)
    assert [o.token_ids for o in given_back] == [o.token_ids for o in kept] and peak < peak_kept


def test_blocks_given_back_let_more_sequences_run_at_once(windowed):
    """Six 70-token prompts decoding 50 tokens each, in a float32 pool of 32 blocks (one request of max_model_len
    512): keeping every block, the six outgrow it (48 blocks) and some are preempted; giving blocks back, all six
    run together, none is preempted, and the tokens are the same."""
    prompts = [prompt(70, seed=seed) for seed in range(6)]
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    pool_bytes = float32_pool_bytes(windowed, 32)

    def run(give_back: bool):
        engine = LLM(str(windowed), kv_cache_memory=pool_bytes).engine
        assert engine.kv_manager.pool.num_blocks == 32
        if not give_back:
            engine.kv_manager.window = None
        outputs, _ = run_with_peak_blocks(engine, prompts, params)
        steps = engine.step_stats
        return [o.token_ids for o in outputs], max(s.num_seqs for s in steps), sum(s.num_preempted for s in steps)

    kept, _, preempted_kept = run(False)
    given_back, most, preempted = run(True)
    assert given_back == kept
    assert preempted_kept > 0 and (most, preempted) == (6, 0)


def test_a_pool_smaller_than_one_whole_context_serves_past_the_window(windowed):
    """Under SARATHI a request past the window holds its window, a chunk and a block (16 + 16 + 16 tokens here), so
    an engine starts on a pool of 4 blocks where one request of max_model_len 512 needs 32: prompts of 30, 70 and
    100 tokens decoding 40 each (up to 140 tokens), run together and so preempted, and the longest again on 48 tokens
    of KV given ready-made, give transformers' greedy output in it. Ready-made KV is placed at once, so 80 tokens of
    it are refused. The schedulers that compute a prompt in one step, and a KV store (which copies a prompt whole),
    still need max_model_len."""
    pool_bytes = float32_pool_bytes(windowed, 4)
    llm = LLM(str(windowed), kv_cache_memory=pool_bytes, chunk_size=16)
    engine = llm.engine
    prompts = [prompt(n, seed=n) for n in (30, 70, 100)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outputs = run_together(engine, prompts, [params] * len(prompts))
    reference = AutoModelForCausalLM.from_pretrained(str(windowed))
    assert [o.token_ids for o in outputs] == [hf_greedy(reference, p, 40) for p in prompts]
    assert sum(s.num_preempted for s in engine.step_stats) > 0
    engine.reset_prefix_cache()
    ids = prompts[2]
    k, v = compute_kv(engine, ids[:48])
    request = engine.add_request(ids, params, preloaded=[PreloadedKV(0, k, v)], cache_salt=b"ready-made")
    [loaded] = llm._run_to_completion([request], False)
    assert loaded.num_cached_tokens == 48 and loaded.token_ids == outputs[2].token_ids
    with pytest.raises(KvstrataError, match="places 80 tokens at once; the KV cache holds 64"):
        engine.add_request(ids, params, preloaded=[PreloadedKV(0, torch.cat([k, k[:, :32]], 1),
                                                               torch.cat([v, v[:, :32]], 1))])
    with pytest.raises(KvstrataError, match=r"past its sliding window \(16 tokens, a chunk of 64 .* --chunk-size"):
        LLM(str(windowed), kv_cache_memory=pool_bytes, chunk_size=64)
    for options in ({"scheduler": "prefill-first"}, {"kv_store": "host:64MiB"}):
        with pytest.raises(KvstrataError, match="fewer than one request of max_model_len 512 holds"):
            LLM(str(windowed), kv_cache_memory=pool_bytes, chunk_size=16, **options)


def test_an_evaluation_window_longer_than_the_pool_scores_past_the_sliding_window(windowed):
    """Scoring through the cache gives back the blocks behind the window as the engine's steps do: 60 tokens of a
    100-token window scored after a 40-token context, in a pool of 4 blocks (64 tokens), give transformers' logits."""
    engine = LLM(str(windowed), kv_cache_memory=float32_pool_bytes(windowed, 4), chunk_size=16).engine
    ids = prompt(100)
    ours = CacheScorer(engine).next_token_logits(ids, context_len=40, tokens_per_step=8)
    theirs = hf_logits(AutoModelForCausalLM.from_pretrained(str(windowed)), ids)[39:99]
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0) and engine.kv_manager.pool.num_used == 0


def test_a_kv_store_copies_the_whole_prompt_before_its_blocks_go_back(windowed):
    """The KV store copies a prompt's chunks once the prompt is computed, so its blocks stay until then (a
    100-token prompt in chunks of 24 holds the 6 blocks of its first 96 tokens after its fourth chunk); the same
    prompt loaded from the store (the device pool's prefix cache forgotten) gives the output of the request that
    computed it."""
    engine = LLM(str(windowed), kv_cache_memory="8MiB", chunk_size=24, kv_store="host:64MiB",
                 kv_store_chunk_tokens=16).engine
    ids = prompt(100)
    [computed], peak = run_with_peak_blocks(engine, [ids], GREEDY)
    assert peak == 6
    engine.kv_store.flush()
    engine.reset_prefix_cache()
    [loaded], _ = run_with_peak_blocks(engine, [ids], GREEDY)
    assert engine.kv_store.stats.loaded_tokens == 96 and loaded.token_ids == computed.token_ids


@pytest.mark.parametrize("options", [{"kv_format": "fp32"}, {"kv_format": "int8/int4"},
                                     {"kv_format": "kivi4", "kivi_residual": 16}])
def test_a_prompt_whose_head_left_the_pool_reuses_the_blocks_its_window_reads(windowed, options):
    """The first blocks of a 70-token prompt taken out of the prefix cache (as the pool hands out first the blocks
    given back behind a window): the same prompt again reads the cached block its first new query's window covers
    (tokens 48-63), so 64 of its tokens are not computed, and it gives the tokens it gave the first time."""
    engine = LLM(str(windowed), kv_cache_memory="8MiB", **options).engine
    ids = prompt(70)
    [first], _ = run_with_peak_blocks(engine, [ids], GREEDY)
    pool = engine.kv_manager.pool
    for block_hash in full_block_hashes(ids, 16, [], engine.kv_manager.namespace)[:3]:
        pool.forget(pool.lookup(block_hash))
    [again], _ = run_with_peak_blocks(engine, [ids], GREEDY)
    assert again.num_cached_tokens == 64 and again.token_ids == first.token_ids


def test_requests_about_one_document_in_a_small_pool_give_transformers_greedy_output(windowed):
    """Eight questions about one 60-token document, all at once, 30 tokens each, in a pool of 8 blocks (the engine's
    least for max_model_len 128): they share the document's blocks, give them back behind the window, match what
    is left of them and are preempted, and each gives transformers' greedy tokens."""
    document = prompt(60)
    prompts = [document + prompt(4 + seed, seed=seed) for seed in range(1, 9)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    pool_bytes = float32_pool_bytes(windowed, 8)
    engine = LLM(str(windowed), kv_cache_memory=pool_bytes, max_model_len=128).engine
    outputs, _ = run_with_peak_blocks(engine, prompts, params)
    reference = AutoModelForCausalLM.from_pretrained(str(windowed))
    assert [o.token_ids for o in outputs] == [hf_greedy(reference, p, 30) for p in prompts]
    assert sum(o.num_cached_tokens for o in outputs) > 0 and sum(s.num_preempted for s in engine.step_stats) > 0


def test_a_kv_store_writes_no_chunk_over_blocks_a_windowed_match_left_behind(windowed):
    """A prompt that matches 96 cached tokens under the window holds only their last block; the store chunk of
    tokens 64-127 reaches into the entries behind the window, so it is not written (its copy would hold another
    block's KV). Loaded from the store later (the device pool's prefix cache forgotten), the prompt gives the
    tokens it gave when computed."""
    engine = LLM(str(windowed), kv_cache_memory="8MiB", kv_store="host:64MiB", kv_store_chunk_tokens=64).engine
    head = prompt(110)
    run_with_peak_blocks(engine, [head], GREEDY)
    ids = head[:96] + prompt(44, seed=1)
    [computed], _ = run_with_peak_blocks(engine, [ids], GREEDY)
    assert computed.num_cached_tokens == 96
    engine.kv_store.flush()
    engine.reset_prefix_cache()
    [loaded], _ = run_with_peak_blocks(engine, [ids], GREEDY)
    assert engine.kv_store.stats.loaded_tokens == 64 and loaded.token_ids == computed.token_ids


@pytest.mark.parametrize("options", [{"kv_offload": "full"}, {"kv_offload": "infinigen"}, {"kv_offload": "h2o"}])
def test_policies_that_choose_their_keys_are_refused_past_the_window(windowed, options):
    option, value = next(iter(options.items()))
    with pytest.raises(KvstrataError, match=f"{option} '{value}' does not read a sliding window; this model's is "
                                            f"{WINDOW} tokens and max_model_len 512 passes it"):
        LLM(str(windowed), kv_cache_memory="8MiB", **options)
    within = LLM(str(windowed), kv_cache_memory="8MiB", max_model_len=WINDOW, kv_offload="full")
    assert not isinstance(within.engine.attention, SlidingWindowAttention)
