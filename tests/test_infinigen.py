"""KV offload (`--kv-offload full|infinigen`): the skew is exact, selecting everything reproduces `none`, the
selection rule on hand-made scores, byte counters against the bytes copied, skew files refused when foreign or
corrupt, the CLI and the server."""

from __future__ import annotations

import math

import numpy as np
import openai
import pytest
import torch

from kvstrata import LLM, SamplingParams
from kvstrata.cli.main import main
from kvstrata.config import EngineConfig
from kvstrata.engine.layer_capture import capture_layers
from kvstrata.errors import KvstrataError
from kvstrata.kv.attention_batch import AttentionGroup, whole_block_keys
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.kernels import paged_decode
from kvstrata.kv.offload import transfers
from kvstrata.kv.offload.fetch_plan import FetchPlan, attend_over_plan
from kvstrata.kv.offload.host_pool import COUNTER_LIMIT, EVICTION_POLICIES, HostPoolCap
from kvstrata.kv.offload.link import parse_link
from kvstrata.kv.offload.skew import ForeignSkewError, InfiniGenSkew
from kvstrata.kv.offload.speculation import select_tokens
from kvstrata.kv.paged_cache import PagedKVCache
from kvstrata.kv.preloaded import PreloadedKV
from kvstrata.kv.reference_attention import attend_per_kv_head
from tests.infinigen_cases import EVERYTHING, engine_for, generate, random_prompts
from tests.server_harness import running_server


@pytest.mark.parametrize("name", ["llama", "opt"])
def test_the_skew_leaves_every_attention_logit_unchanged(name, tiny_llama, tiny_opt, skew_files):
    """Q̃K̃ᵀ = QKᵀ per (layer, KV head) on text the skew was not calibrated on: grouped-query (the tiny Llama, RoPE,
    4 query heads over 2 KV heads) and multi-head (the tiny OPT); and the rotation does concentrate the queries."""
    model = {"llama": tiny_llama, "opt": tiny_opt}[name]
    engine = engine_for(model)
    skew = InfiniGenSkew.load(skew_files[name], engine.model_fingerprint)
    captured = capture_layers(engine, random_prompts(3, 150)[0])
    q, k = captured["q"], captured["k"]
    layers, tokens, heads, dim = q.shape
    kv_heads = k.shape[2]
    for layer in range(layers):
        for head in range(heads):
            a = skew.rotation[layer, head // (heads // kv_heads)].double()
            qh, kh = q[layer, :, head].double(), k[layer, :, head // (heads // kv_heads)].double()
            logits = qh @ kh.T  # float tolerance: A is stored in float32, orthogonal to ~1e-7
            torch.testing.assert_close((qh @ a) @ (kh @ a).T, logits, rtol=0, atol=1e-6 * float(logits.abs().max()))
    grouped = q.view(layers, tokens, kv_heads, -1, dim).transpose(1, 2).reshape(layers, kv_heads, -1, dim)
    skewed = grouped @ skew.rotation
    first = lambda x: x[..., : dim // 4].square().sum() / x.square().sum()
    assert first(skewed) > first(grouped)


@pytest.mark.usefixtures("block_products_alike_for_any_rows")  # the tight cache's steps hold other rows
@pytest.mark.parametrize(("name", "paged_kernel"), [("llama", True), ("opt", True), ("gguf", True), ("llama", False)])
def test_selecting_every_token_gives_the_greedy_output_of_no_offload(name, paged_kernel, tiny_llama, tiny_opt,
                                                                     tiny_gguf_style, skew_files):
    """alpha = inf with no cap: infinigen attends over every cached token, so its greedy tokens are `none`'s, with
    prompts that share a prefix (prefix caching) and a cache small enough to preempt; `full` too. Both the compiled
    selection and attention and the torch path (--no-paged-kernel); GGUF blocks, as the default model's, where the
    layers and the speculation run the compiled layer halves."""
    model = {"llama": tiny_llama, "opt": tiny_opt, "gguf": tiny_gguf_style}[name]
    shared = random_prompts(4, 48)[0]
    prompts = [shared + p for p in random_prompts(5, 30, 70, 5)] + random_prompts(6, 90)
    want = generate(engine_for(model, paged_kernel=paged_kernel), prompts, 16)
    assert generate(engine_for(model, kv_offload="full", paged_kernel=paged_kernel), prompts, 16) == want
    engine = engine_for(model, kv_offload="infinigen", infinigen_calibration=str(skew_files[name]),
                        paged_kernel=paged_kernel, **EVERYTHING)
    assert (engine.attention.kernel is not None) == paged_kernel
    assert generate(engine, prompts, 16) == want
    summary = engine.attention.stats.summary()
    assert summary["decode_fraction_fetched"] > 0.9  # all but each step's own token, which is on the device
    kv_heads, dim = engine.kv_cache.kv_shape
    token_bytes = 2 * engine.kv_cache.num_layers * kv_heads * dim * 4
    tight = engine_for(model, kv_offload="infinigen", infinigen_calibration=str(skew_files[name]), max_model_len=200,
                       kv_cache_memory=14 * 16 * token_bytes, paged_kernel=paged_kernel,
                       **EVERYTHING)  # 14 blocks: fewer than the prompts need
    assert generate(tight, prompts, 16) == want
    assert sum(s.num_preempted for s in tight.step_stats) > 0


def test_default_speculation_fetches_a_capped_subset(tiny_llama, skew_files):
    engine = engine_for(tiny_llama, kv_offload="infinigen", infinigen_calibration=str(skew_files["llama"]),
                        infinigen_full_layers=1, infinigen_alpha=1.0, infinigen_diagnostics=True)
    generate(engine, random_prompts(7, 200, 120), 12)
    stats = engine.attention.stats
    assert stats.decode_fetched_rows[0] == stats.decode_cached_rows[0]  # layer 0 reads everything
    assert 0 < stats.decode_fetched_rows[1:].sum() < 0.6 * stats.decode_cached_rows[1:].sum()
    assert stats.selected_per_head[1:].sum() <= 0.2 * stats.decode_cached_rows[1:].sum() / 2  # 2 KV heads
    assert 0 < stats.summary()["recall_of_attention_mass"] < 1


def chosen_columns(selection) -> set[int]:
    """The columns KV head 0 of sequence 0 reads."""
    return set(selection.chosen[0, 0].nonzero().flatten().tolist())


def test_select_tokens_on_hand_made_scores():
    """One sequence, one KV head shared by two query heads, six cached tokens of seven."""
    scores = torch.tensor([[[[9.0, 8.5, 1.0, 0.0, 8.8, 2.0, 100.0],    # head 0: 3 tokens within alpha = 1
                             [0.0, 1.0, 5.0, 4.5, 0.0, 4.2, 100.0]]]])  # head 1: 3 tokens within 1
    cached = torch.tensor([[True, True, True, True, True, True, False]])  # the last key is this step's own
    selection = select_tokens(scores, cached, alpha=1.0, max_fraction=1.0)
    assert selection.per_query_head.tolist() == [3]
    assert chosen_columns(selection) == {0, 1, 4} | {2, 3, 5}  # the union of both heads' top 3; never the uncached key
    capped = select_tokens(scores, cached, alpha=1.0, max_fraction=0.34)  # floor(0.34 * 6) = 2 per head
    assert capped.per_query_head.tolist() == [2]
    assert chosen_columns(capped) == {0, 4, 2, 3}
    everything = select_tokens(scores, cached, alpha=math.inf, max_fraction=1.0)
    assert chosen_columns(everything) == set(range(6))
    # heads with different counts share their floored mean: with alpha 0.3 head 0 has 2 tokens, head 1 one
    mean = select_tokens(scores, cached, alpha=0.3, max_fraction=1.0)
    assert mean.per_query_head.tolist() == [1]
    assert chosen_columns(mean) == {0, 2}


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_float_pool_copies_what_it_stores_into_the_buffers_it_is_handed(dtype, compiled):
    """Offload on the CPU: whole blocks (`full`'s transfer) and each head's own rows (InfiniGen's gather) as stored,
    no decode, in the pool's dtype, land in the caller's buffers, holding what gather_keys and gather_per_head read."""
    pool = PagedKVCache(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype,
                        device=torch.device("cpu"), in_place_decode=compiled)
    assert (pool.decode_kernel is not None) == compiled
    pool.k.copy_(torch.randn(pool.k.shape))
    pool.v.copy_(torch.randn(pool.v.shape))
    tables = torch.tensor([[3, 1], [0, 5]])
    handed = {}

    def empty(name, shape, buffer_dtype):
        handed[name] = torch.full(shape, math.nan, dtype=buffer_dtype)
        return handed[name]

    copied = pool.copy_stored_blocks(1, tables, empty)
    gathered = pool.gather_keys(1, whole_block_keys(tables, torch.tensor([8, 7]), 4), dtype)
    for name, got, want in zip(("k", "v"), copied, gathered):
        assert got.dtype == dtype and got.untyped_storage().data_ptr() == handed[name].untyped_storage().data_ptr()
        assert got.shape == want.shape == (2, 8, 2, 8) and torch.equal(got, want)
    slots = torch.tensor([[5, 0, 17], [9, 9, 2]])
    copied = pool.copy_stored_rows(1, slots, empty)
    gathered = pool.gather_per_head(1, slots[:, None], torch.zeros_like(slots[:, None]), dtype)
    for name, got, want in zip(("k", "v"), copied, gathered):
        assert got.dtype == dtype and got.untyped_storage().data_ptr() == handed[name].untyped_storage().data_ptr()
        assert got.shape == (2, 3, 8) and torch.equal(got, want[:, 0])


@pytest.mark.parametrize("mode", ["full", "infinigen"])
def test_byte_counters_equal_the_bytes_copied(mode, tiny_llama, skew_files, monkeypatch):
    copied = []  # bytes copied into the device buffers, or handed out there to be written (a float pool's blocks)
    copy, empty = transfers.WorkingBuffers.copy, transfers.WorkingBuffers.empty

    def counting_copy(buffers, name, x, stream=None):
        copied.append(x.nbytes)
        return copy(buffers, name, x, stream)

    def counting_empty(buffers, name, shape, dtype):
        copied.append(math.prod(shape) * dtype.itemsize)
        return empty(buffers, name, shape, dtype)

    monkeypatch.setattr(transfers.WorkingBuffers, "copy", counting_copy)
    monkeypatch.setattr(transfers.WorkingBuffers, "empty", counting_empty)
    engine = engine_for(tiny_llama, kv_offload=mode, infinigen_calibration=str(skew_files["llama"]),
                        infinigen_full_layers=1, infinigen_alpha=2.0, kv_link="2")
    generate(engine, random_prompts(8, 100, 40), 8)
    stats = engine.attention.stats
    assert sum(copied) == stats.copied_bytes.sum() > 0
    assert stats.stored_form_bytes.sum() <= stats.copied_bytes.sum()  # padding rows are copied, not counted
    link = parse_link("2")  # 2 GB/s
    modeled = stats.stored_form_bytes.sum() / link.bytes_per_second
    assert stats.modeled_transfer_s.sum() == pytest.approx(modeled + stats.transfers * link.latency_s)


def test_preloaded_kv_gets_its_partial_keys(tiny_llama, skew_files):
    """KV placed without a forward pass (a saved context, a lower tier's chunk) has partial keys on the device."""
    engine = engine_for(tiny_llama, kv_offload="infinigen", infinigen_calibration=str(skew_files["llama"]))
    policy = engine.attention
    kv_heads, dim = engine.kv_cache.kv_shape
    k = torch.randn(3, 40, kv_heads, dim)
    blocks = [engine.kv_manager.pool.allocate() for _ in range(3)]
    policy.write(blocks, PreloadedKV(0, k, torch.randn_like(k)), 0, 40)
    slots = torch.tensor([blocks[p // 16] * 16 + p % 16 for p in range(40)])
    for layer in range(3):
        want = torch.einsum("tgd,gdr->gtr", k[layer], policy.partial_rotation[layer])
        # stored in float16: within its rounding
        torch.testing.assert_close(policy.partial_keys.of_slots(layer, slots), want, rtol=1e-3, atol=1e-3)


def test_skew_files_are_versioned_and_refused_when_foreign_or_corrupt(tiny_llama, skew_files, tmp_path):
    engine = engine_for(tiny_llama)
    skew = InfiniGenSkew.load(skew_files["llama"], engine.model_fingerprint)
    with pytest.raises(ForeignSkewError, match="calibrated for model"):
        InfiniGenSkew.load(skew_files["llama"], "0123456789abcdef")
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(skew_files["llama"].read_bytes()[:300])
    with pytest.raises(KvstrataError, match="not a readable infinigen skew"):
        InfiniGenSkew.load(truncated, engine.model_fingerprint)
    with pytest.raises(KvstrataError, match="not orthogonal"):
        InfiniGenSkew(skew.fingerprint, skew.rotation * 1.01, skew.column_weights, 1, 1, "")
    newer = tmp_path / "newer.npz"
    data = dict(np.load(skew_files["llama"]))
    data["meta"] = np.frombuffer(bytes(data["meta"]).replace(b'"version": 1', b'"version": 99'), dtype=np.uint8)
    np.savez(newer, **data)
    with pytest.raises(KvstrataError, match="version 99"):
        InfiniGenSkew.load(newer, engine.model_fingerprint)
    with pytest.raises(KvstrataError, match="calibrated for model"):
        engine_for(tiny_llama, kv_offload="infinigen", infinigen_calibration=str(skew_files["opt"]))


@pytest.mark.parametrize("option, value", [("kv_offload", "disk"), ("kv_link", "pcie9"), ("infinigen_alpha", 0.0),
                                           ("infinigen_max_fraction", 1.5), ("infinigen_full_layers", 0),
                                           ("infinigen_partial_ratio", 0.0)])
def test_bad_offload_options_are_refused_by_name(option, value):
    with pytest.raises(KvstrataError, match=option):
        EngineConfig(**{option: value})


def test_generate_and_calibrate_from_the_command_line(tiny_llama, tmp_path, capsys):
    skew = tmp_path / "skew.npz"
    text = tmp_path / "text.txt"
    text.write_text("Emma Woodhouse, handsome, clever, and rich, with a comfortable home. " * 60)
    assert main(["calibrate", "infinigen", "--text", str(text), "--out", str(skew), "--windows", "2",
                 "--window-tokens", "128", "--model", str(tiny_llama), "--kv-cache-memory", "8MiB"]) == 0
    assert "wrote the infinigen skew" in capsys.readouterr().out
    assert main(["generate", "Emma", "--model", str(tiny_llama), "--max-tokens", "8", "--kv-cache-memory", "8MiB",
                 "--kv-offload", "infinigen", "--infinigen-calibration", str(skew)]) == 0
    assert capsys.readouterr().out.strip()


def test_the_server_runs_with_infinigen(tiny_llama, skew_files):
    with running_server(str(tiny_llama), "test-model", kv_cache_memory="8MiB", max_model_len=256,
                        kv_offload="infinigen", infinigen_calibration=str(skew_files["llama"]),
                        **EVERYTHING) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(model="test-model", prompt="Emma Woodhouse, handsome", max_tokens=8,
                                          temperature=0)
    plain = LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256)
    expected = plain.generate(["Emma Woodhouse, handsome"], SamplingParams(max_tokens=8, temperature=0))[0]
    assert reply.choices[0].text == expected.text


def test_h2o_evicts_for_good_at_its_budget(tiny_llama):
    """After every decode each KV head of each layer keeps at most the budget of a sequence's tokens, evicted tokens
    never come back, and a budget of every token is full attention (the greedy output of `none`)."""
    prompts = random_prompts(11, 120, 60)
    want = generate(engine_for(tiny_llama), prompts, 12)
    assert generate(engine_for(tiny_llama, kv_offload="h2o", h2o_budget=1.0), prompts, 12) == want
    engine = engine_for(tiny_llama, kv_offload="h2o", h2o_budget=0.25)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seq = engine._sequences[engine.add_request(prompts[0], params)]
    before = engine.attention.evicted.clone()
    decodes = 0
    while engine.has_unfinished_requests():
        engine.step()
        evicted = engine.attention.evicted.clone()
        assert (before <= evicted).all()  # never revived
        before = evicted
        if engine.has_unfinished_requests() and seq.num_computed_tokens > len(prompts[0]):
            decodes += 1
            slots = [seq.block_table[p // 16] * 16 + p % 16 for p in range(seq.num_computed_tokens)]
            live = (~evicted[:, :, slots]).sum(-1)  # [layers, kv heads]
            assert (live == int(0.25 * seq.num_computed_tokens)).all()
    assert decodes > 5


def policy(name: str):
    return EVICTION_POLICIES[name](num_layers=1, num_slots=8, device=torch.device("cpu"))


def test_fifo_lru_and_counter_pick_their_victims_on_hand_made_traces():
    live = torch.tensor([True] * 6 + [False] * 2)
    written = torch.arange(6)
    fifo, lru, counter = policy("fifo"), policy("lru"), policy("counter")
    for p in (fifo, lru, counter):
        p.written(0, written)
    assert set(fifo.victims(0, live, 2).tolist()) == {0, 1}  # the oldest
    lru.fetched(0, torch.tensor([0, 1]))
    assert set(lru.victims(0, live, 2).tolist()) == {2, 3}  # 0 and 1 were used since
    for slots in ([0], [0], [0], [1], [1], [2], [4], [4], [4], [4]):
        counter.fetched(0, torch.tensor(slots))
    # the older half is {0, 1, 2}; among them the fewest fetches: 2 (once), then 1 (twice); never 3 or 5
    assert counter.victims(0, live, 1).tolist() == [2]
    assert set(counter.victims(0, live, 2).tolist()) == {1, 2}
    for _ in range(COUNTER_LIMIT):
        counter.fetched(0, torch.tensor([3]))
    assert counter.counters[0, 3] == COUNTER_LIMIT // 2 and counter.counters[0, 0] == 1  # every counter halved


def test_a_capped_pool_gives_up_tokens_for_good_and_its_blocks_leave_the_prefix_index():
    pool = BlockPool(2)
    blocks = [pool.allocate(), pool.allocate()]
    pool.register(blocks[0], b"first")
    cap = HostPoolCap(capacity=5, policy="fifo", num_layers=1, num_slots=8, block_size=4, device=torch.device("cpu"))
    cap.attach_block_pool(pool)
    cap.begin_step()
    cap.stored(0, torch.tensor([4 * blocks[0] + i for i in range(4)]))
    assert not cap.dead.any()
    cap.stored(0, torch.tensor([4 * blocks[1], 4 * blocks[1] + 1]))
    assert cap.dead[0].nonzero().flatten().tolist() == [4 * blocks[0]] and cap.evictions == 1
    assert pool.lookup(b"first") is None  # no longer whole: no later request may reuse it
    cap.reset_blocks([blocks[0]])
    assert not cap.dead.any() and int(cap.live.sum()) == 2


@pytest.mark.parametrize("eviction", ["counter", "lru", "fifo"])
def test_infinigen_under_a_host_memory_cap(eviction, tiny_llama, skew_files):
    """A cap that holds everything changes nothing; a smaller one keeps at most its tokens readable per layer."""
    prompts = random_prompts(12, 150, 90)
    want = generate(engine_for(tiny_llama), prompts, 12)
    roomy = engine_for(tiny_llama, kv_offload="infinigen", infinigen_calibration=str(skew_files["llama"]),
                       kv_host_memory="4MiB", kv_host_eviction=eviction, **EVERYTHING)
    assert generate(roomy, prompts, 12) == want and roomy.attention.cap.evictions == 0
    tight = engine_for(tiny_llama, kv_offload="infinigen", infinigen_calibration=str(skew_files["llama"]),
                       kv_host_memory=200 * 768, kv_host_eviction=eviction, **EVERYTHING)  # 200 tokens of 768 bytes
    outputs = generate(tight, prompts, 12)
    assert all(len(o) == 12 for o in outputs) and tight.attention.cap.evictions > 0
    assert (tight.attention.cap.live.sum(-1) <= 200).all()


def test_kv_host_memory_needs_infinigen():
    with pytest.raises(KvstrataError, match="kv_host_memory caps InfiniGen"):
        EngineConfig(kv_host_memory="1GiB", kv_offload="full")


def test_a_host_memory_below_one_token_says_what_one_token_takes(tiny_llama, skew_files):
    with pytest.raises(KvstrataError, match="kv_host_memory of 700 bytes holds no token; a token's K and V take "
                                            "768 bytes in this format"):
        engine_for(tiny_llama, kv_offload="infinigen", infinigen_calibration=str(skew_files["llama"]),
                   kv_host_memory=700)


def test_the_top_k_is_wide_enough_where_float32_rounds_the_cap_up():
    """The cap is floor(max_fraction x cached tokens) in float32: 0.29 x 100 gives 29 there, 28 in double. The top-k,
    sized on the host without reading the counts back, must still hold every sequence's count."""
    scores = torch.randn(1, 1, 1, 100, generator=torch.Generator().manual_seed(1))
    selection = select_tokens(scores, torch.ones(1, 100, dtype=torch.bool), alpha=math.inf, max_fraction=0.29)
    assert selection.per_query_head.tolist() == [29]
    assert int(selection.chosen.sum()) == 29


def test_working_buffers_copy_strided_and_permuted_tensors():
    buffers = transfers.WorkingBuffers(torch.device("cpu"))
    x = torch.randn(3, 8, 5, generator=torch.Generator().manual_seed(2))
    heads_outermost = x.permute(1, 0, 2)  # every element of its span: kept with its strides
    copied = buffers.copy("a", heads_outermost)
    assert torch.equal(copied, heads_outermost) and copied.stride() == heads_outermost.stride()
    every_other = x[:, ::2]  # gaps between its elements: laid out densely
    assert torch.equal(buffers.copy("b", every_other), every_other)


def test_each_sequence_reads_its_own_count_of_tokens():
    """The top-k takes as many tokens as the widest row may need: a sequence that chose fewer reads its own choice
    only, and a query head's entry past the count never clears a column another query head of its KV head chose."""
    scores = torch.tensor([[[[9.0, 8.9, 8.8, 8.7, 0.0, 0.0]],     # sequence 0: four tokens within alpha
                            [[0.0, 9.0, 0.0, 0.0, 0.0, 0.0]]]])  # sequence 1: one token
    cached = torch.ones(2, 6, dtype=torch.bool)
    selection = select_tokens(scores, cached, alpha=1.0, max_fraction=1.0)
    assert selection.per_query_head.tolist() == [4, 1]
    assert selection.chosen.int().tolist() == [[[1, 1, 1, 1, 0, 0], [0, 1, 0, 0, 0, 0]]]
    shared = torch.tensor([[[[9.0, 8.5, 0.0, 0.0],     # query head 0: two tokens within alpha
                             [5.0, 0.0, 9.0, 0.0]]]])  # query head 1: one; its second best is head 0's first
    selection = select_tokens(shared, torch.ones(1, 4, dtype=torch.bool), alpha=1.0, max_fraction=1.0)
    assert selection.per_query_head.tolist() == [1]  # the floored mean of 2 and 1
    assert chosen_columns(selection) == {0, 2}


@pytest.mark.parametrize("kv_format", ["int8", "int4", "fp8", "int8/int4", "fp16"])
def test_infinigen_over_a_quantized_host_pool(kv_format, tiny_llama, skew_files):
    """Any --kv-format can be the host pool: selecting everything gives that format's greedy output without offload,
    and the bytes counted in stored form are the format's (fewer than the float32 rows copied)."""
    prompts = random_prompts(13, 120, 60)
    want = generate(engine_for(tiny_llama, kv_format=kv_format), prompts, 10)
    engine = engine_for(tiny_llama, kv_format=kv_format, kv_offload="infinigen",
                        infinigen_calibration=str(skew_files["llama"]), **EVERYTHING)
    assert generate(engine, prompts, 10) == want
    stats = engine.attention.stats
    assert 0 < stats.stored_form_bytes.sum() < stats.copied_bytes.sum()


def test_the_recent_window_is_always_read():
    scores = torch.tensor([[[[9.0, 0.0, 0.0, 0.0, 0.0, 0.0]]]])
    cached = torch.tensor([[True, True, True, True, True, False]])
    recent = torch.tensor([[False, False, False, True, True, True]])  # the last is this step's own, not cached
    selection = select_tokens(scores, cached, alpha=1.0, max_fraction=1.0, always=recent)
    assert selection.chosen.int().tolist() == [[[1, 0, 0, 1, 1, 0]]]


@pytest.mark.parametrize(("alpha", "max_fraction", "recent", "capped", "block_size"),
                         [(1.0, 0.2, 0, False, 16), (3.0, 0.5, 4, True, 16), (math.inf, 1.0, 0, False, 16),
                          (0.5, 1.0, 40, True, 16), (2.0, 0.3, 8, False, 12)])
def test_the_compiled_selection_chooses_what_the_torch_path_does(alpha, max_fraction, recent, capped, block_size,
                                                                 tiny_llama, skew_files):
    """Random partial keys and queries, scattered blocks (of 16 tokens, and of 12: not whole vectors of 8),
    sequences of different lengths (one with nothing cached yet), tokens a capped pool gave up: the kernel's plan
    (positions, slots, offsets, counts) is the torch path's."""
    options = {"kv_host_memory": "4MiB"} if capped else {}
    engine = engine_for(tiny_llama, kv_offload="infinigen", infinigen_calibration=str(skew_files["llama"]),
                        infinigen_alpha=alpha, infinigen_max_fraction=max_fraction, infinigen_recent=recent,
                        block_size=block_size, **options)
    policy = engine.attention
    assert policy.kernel is not None
    gen = torch.Generator().manual_seed(3)
    layer, block = 1, policy.storage.block_size
    policy.partial_keys.data[layer] = torch.randn(policy.partial_keys.data[layer].shape, generator=gen)
    num_blocks = policy.partial_keys.data.shape[2]
    if capped:
        policy.cap.dead[layer] = torch.rand(policy.cap.dead.shape[1], generator=gen) < 0.3
    context_lens = torch.tensor([1, 37, 160, 96])
    tables = torch.randperm(num_blocks, generator=gen)[:4 * 14].view(4, 14)
    group = AttentionGroup(slice(0, 4), (context_lens - 1)[:, None], context_lens,
                           whole_block_keys(tables, context_lens, block))
    _, kv_heads, _, partial = policy.partial_rotation.shape
    q_partial = torch.randn(4, kv_heads, engine.loaded.config.num_heads // kv_heads, partial, generator=gen)
    compiled = policy._select_in_place(layer, q_partial, group)
    reference = policy._select(layer, q_partial.transpose(0, 1), group)
    assert torch.equal(compiled.per_query_head, reference.per_query_head)
    assert torch.equal(compiled.offsets, reference.offsets) and torch.equal(compiled.positions, reference.positions)
    chosen = reference.chosen_rows()  # padding rows, and the own token's (written at attention), may read any slot
    assert torch.equal(compiled.chosen_rows(), chosen) and torch.equal(compiled.slots[chosen], reference.slots[chosen])
    assert (compiled.offsets[:, 1] == 1).all()  # sequence 0 has nothing cached: its own token is its one row


def test_attention_over_fetched_rows_compiled_equals_the_masked_torch_product():
    """Sequences of 1 to 6 rows per KV head, one after another with padding after a head's last row (InfiniGen's
    plan), or with gaps between them (`full`'s whole contexts): each sequence's query heads attend over exactly
    their own rows."""
    kernel = paged_decode.kernel()
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, 6, 8, generator=gen)  # 3 sequences, 6 query heads over 2 KV heads
    k, v = torch.randn(2, 2, 11, 8, generator=gen).unbind(0)
    offsets = torch.tensor([[0, 1, 5, 11], [0, 6, 7, 9]])
    plan = FetchPlan(torch.zeros(2, 11, dtype=torch.long), torch.zeros(2, 11, dtype=torch.long), offsets,
                     torch.zeros(3, dtype=torch.long))
    mask = plan.sequence_of_rows()[:, None, :] == torch.arange(3)[:, None]
    want = attend_per_kv_head(q[None], k[:, None], v[:, None], mask[:, None])[0]
    got = kernel.fetched_attention(q, k, v, offsets[:, :-1], offsets.diff(dim=-1), 8**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attend_over_plan(q, k, v, plan.offsets, plan.widest_run), want, rtol=1e-5,
                               atol=1e-5)  # the torch path
    starts, lengths = torch.tensor([[0, 4, 8]]).expand(2, 3), torch.tensor([[2, 4, 1]]).expand(2, 3)
    rows = torch.arange(11)
    mask = (rows >= starts[..., None]) & (rows < (starts + lengths)[..., None])  # [2, 3, 11]
    want = attend_per_kv_head(q[None], k[:, None], v[:, None], mask[:, None])[0]
    torch.testing.assert_close(kernel.fetched_attention(q, k, v, starts, lengths, 8**-0.5), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="at least one"):
        kernel.fetched_attention(q, k, v, starts, torch.tensor([[2, 0, 1]]).expand(2, 3), 8**-0.5)


def test_gathering_rows_compiled_equals_index_select():
    kernel = paged_decode.kernel()
    gen = torch.Generator().manual_seed(6)
    k, v = torch.randn(2, 3, 40, 8, generator=gen).unbind(0)
    slots = torch.randint(0, 40, (3, 17), generator=gen)
    outs = [torch.empty(3, 17, 8), torch.empty(3, 17, 8)]
    kernel.gather_rows([k, v], slots, outs)
    for pool, got in zip((k, v), outs):
        assert torch.equal(got, torch.stack([pool[h].index_select(0, slots[h]) for h in range(3)]))
    with pytest.raises(RuntimeError, match="slot 40 out of range"):
        kernel.gather_rows([k, v], torch.full((3, 2), 40), [torch.empty(3, 2, 8), torch.empty(3, 2, 8)])
    with pytest.raises(RuntimeError, match="each out must be"):
        kernel.gather_rows([k, v], slots, [torch.empty(3, 16, 8), torch.empty(3, 17, 8)])


def test_the_compiled_selection_survives_nan_partial_keys(tiny_llama, skew_files):
    """A corrupt cache's NaN logits are never preferred and never upset the search: every sequence still gets its
    count of tokens per query head (its request then fails on its own, on non-finite logits)."""
    engine = engine_for(tiny_llama, kv_offload="infinigen", infinigen_calibration=str(skew_files["llama"]))
    policy = engine.attention
    policy.partial_keys.data[1] = float("nan")
    policy.partial_keys.data[1, :, 0] = 1.0  # block 0 stays finite
    context_lens = torch.tensor([40, 40])
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]])
    group = AttentionGroup(slice(0, 2), (context_lens - 1)[:, None], context_lens,
                           whole_block_keys(tables, context_lens, policy.storage.block_size))
    _, kv_heads, _, partial = policy.partial_rotation.shape
    plan = policy._select_in_place(1, torch.ones(2, kv_heads, 2, partial), group)
    assert (plan.per_query_head >= 1).all() and ((plan.positions >= 0) & (plan.positions < 40)).any()
    assert torch.equal(plan.offsets[:, 1:] - plan.offsets[:, :-1] >= plan.per_query_head + 1,
                       torch.ones_like(plan.offsets[:, 1:], dtype=torch.bool))


def test_a_nan_in_one_sequences_fetched_rows_stays_in_its_output():
    """A corrupt cache fails its own request only: NaN values among sequence 1's rows make its output NaN and leave
    the other sequences of the batch finite, compiled and on the torch path."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 4, 8, generator=gen)
    k, v = torch.randn(2, 2, 9, 8, generator=gen).unbind(0)
    offsets = torch.tensor([[0, 3, 6, 9], [0, 2, 5, 9]])
    plan = FetchPlan(torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 9, dtype=torch.long), offsets,
                     torch.zeros(3, dtype=torch.long))
    v[0, 4] = float("nan")  # KV head 0, a row of sequence 1
    for out in (paged_decode.kernel().fetched_attention(q, k, v, offsets[:, :-1], offsets.diff(dim=-1), 8**-0.5),
                attend_over_plan(q, k, v, plan.offsets, plan.widest_run)):
        assert out.isnan().flatten(1).any(1).tolist() == [False, True, False]


def test_tied_logits_take_the_earliest_tokens(tiny_llama, skew_files):
    """Every cached token scores the same (far more ties than the search sorts out at once): each query head takes its
    count of the earliest tokens, so every KV head fetches exactly those."""
    engine = engine_for(tiny_llama, kv_offload="infinigen", infinigen_calibration=str(skew_files["llama"]),
                        infinigen_recent=0)
    policy = engine.attention
    policy.partial_keys.data[1] = 0.5
    context_lens = torch.tensor([161, 97])
    tables = torch.arange(22).view(2, 11)
    group = AttentionGroup(slice(0, 2), (context_lens - 1)[:, None], context_lens,
                           whole_block_keys(tables, context_lens, policy.storage.block_size))
    _, kv_heads, _, partial = policy.partial_rotation.shape
    plan = policy._select_in_place(1, torch.ones(2, kv_heads, 3, partial), group)
    assert plan.per_query_head.tolist() == [32, 19]  # every token within alpha: capped at 20% of 160 and 96
    for head in range(kv_heads):
        assert plan.positions[head, :33].tolist() == [*range(32), 160]
        assert plan.positions[head, 33:53].tolist() == [*range(19), 96]
