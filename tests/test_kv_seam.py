"""The KV seam: storage (store/gather by slot) apart from the attention policy (which keys each layer reads),
keys with explicit positions, step hooks, the block pool's eviction listeners, prefix sources below the pool,
namespaced block hashes, the format registry, the import rule of kv/ and the runner's persistent block tables."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kvstrata
from kvstrata import LLM, SamplingParams
from kvstrata.config import KV_FORMATS, EngineConfig
from kvstrata.engine.block_tables import BlockTables
from kvstrata.engine.kv_setup import stored_form
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sequence import Sequence
from kvstrata.errors import KvstrataError
from kvstrata.kv import attention_policy, cache_factory, reference_attention
from kvstrata.kv.attention_policy import AttentionPolicy
from kvstrata.kv.block_groups import GroupedBlockPool
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.cache_factory import CacheShape, FormatOptions, storage_layout
from kvstrata.kv.kernels import paged_decode
from kvstrata.kv.preloaded import LayerwiseKV, PreloadedKV
from kvstrata.kv.reference_attention import (
    CHUNK_SPLIT_FROM_QUERIES,
    NO_KEY,
    attend,
    attend_prompt_chunk,
    causal_attention,
    causal_mask,
    prompt_chunk_in_two_calls,
)
from kvstrata.kv.storage import KVStorage
from tests.helpers import use_policy

BLOCK_SIZE = 16
NUM_LAYERS = 3  # the tiny Llama: 3 layers, 2 KV heads of 16
BLOCK_BYTES = BLOCK_SIZE * 2 * NUM_LAYERS * 2 * 16 * 4  # one fp32 block: tokens * (K, V) * layers * heads * dim * 4


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def random_ids(seed: int, *lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=gen).tolist() for n in lengths]


def new_engine(model, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), **{"kv_cache_memory": "2MiB", "threads": 1, **options}))


def probe(token_ids: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"probe{seq_id}", prompt=None, prompt_token_ids=list(token_ids),
                    params=SamplingParams())


@torch.inference_mode()
def run_step(engine: LLMEngine, work: list[tuple[Sequence, int]]) -> torch.Tensor:
    """One forward of `work` through the engine's runner (and its current policy); logits of every packed token."""
    for seq, n in work:
        assert engine.kv_manager.grow(seq, n)
    _, hidden = engine.runner.forward(work)
    for seq, n in work:
        seq.num_computed_tokens += n
    return engine.runner.model.compute_logits(hidden).float()


def prefill_and_sample(engine: LLMEngine, seqs: list[Sequence]) -> None:
    """Prefill each sequence with the engine's policy and append its greedy next token: each then decodes one."""
    for seq in seqs:
        logits = run_step(engine, [(seq, seq.num_pending_tokens)])
        seq.token_ids.append(int(logits[-1].argmax()))


def run_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
    """Generate every prompt with `engine.step`; the engine's sequences, finished, in the prompts' order."""
    ids = [engine.add_request(p, params) for p in prompts]
    seqs = [engine._sequences[i] for i in ids]
    while engine.has_unfinished_requests():
        engine.step()
    return seqs


def textbook_attention(q, k, v, q_positions, key_positions) -> torch.Tensor:
    """softmax(q.k / sqrt(D)) v in float64, one query and head at a time, over the keys (in any order) whose
    position is at most the query's; query head h reads KV head h // (heads / kv_heads)."""
    n, num_q, heads, dim = q.shape
    group = heads // k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(n):
        for t in range(num_q):
            seen = [j for j in range(k.shape[1]) if 0 <= key_positions[i, j] <= q_positions[i, t]]
            for h in range(heads):
                keys, values = k[i, seen, h // group].double(), v[i, seen, h // group].double()
                weights = torch.softmax(keys @ q[i, t, h].double() / math.sqrt(dim), dim=0)
                out[i, t, h] = weights @ values
    return out


# --- 1, 2: keys carry positions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_queries", [1, 4])
def test_attention_over_a_shuffled_subset_of_keys_is_softmax_over_exactly_those_keys(num_queries):
    """Keys given as a random subset of a sequence's tokens, in shuffled order, with their true positions:
    `causal_attention` is textbook softmax attention over exactly the subset's keys at or before each query
    (grouped-query: 6 query heads over 2 KV heads); the single-query (decode) path and the batched one both."""
    gen = torch.Generator().manual_seed(1)
    n, context, heads, kv_heads, dim, kept = 3, 20, 6, 2, 8, 9
    q = torch.randn(n, num_queries, heads, dim, generator=gen)
    k = torch.randn(n, context, kv_heads, dim, generator=gen)
    v = torch.randn(n, context, kv_heads, dim, generator=gen)
    q_positions = torch.arange(context - num_queries, context).expand(n, -1)
    picked = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long),  # position 0: every query sees a key
                                     torch.randperm(context - 1, generator=gen)[: kept - 1] + 1])
                          for _ in range(n)])
    picked = picked.gather(1, torch.stack([torch.randperm(kept, generator=gen) for _ in range(n)]))  # shuffled
    rows = torch.arange(n)[:, None]
    got = causal_attention(q, k[rows, picked], v[rows, picked], q_positions, picked)
    want = textbook_attention(q, k[rows, picked], v[rows, picked], q_positions, picked)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    everything = causal_attention(q, k, v, q_positions, torch.arange(context).expand(n, -1))
    assert not torch.allclose(got, everything, atol=1e-3)  # the subset mattered


@pytest.mark.parametrize("num_queries", [1, 3])
def test_padding_rows_and_later_keys_do_not_change_the_output(num_queries):
    """Rows at position NO_KEY holding huge finite garbage, inserted among the keys, leave the output as it is
    without them; a query is unchanged when keys after its position change, and changes when an earlier one does."""
    gen = torch.Generator().manual_seed(2)
    n, context, heads, kv_heads, dim = 2, 12, 6, 2, 8
    q = torch.randn(n, num_queries, heads, dim, generator=gen)
    k = torch.randn(n, context, kv_heads, dim, generator=gen)
    v = torch.randn(n, context, kv_heads, dim, generator=gen)
    q_positions = torch.tensor([[5, 8, 11][:num_queries]] * n)
    key_positions = torch.arange(context).expand(n, -1)
    plain = causal_attention(q, k, v, q_positions, key_positions)

    pad = 5
    order = torch.randperm(context + pad, generator=gen)  # padding rows scattered among the real ones
    k_pad = torch.cat([k, 1e30 * torch.randn(n, pad, kv_heads, dim, generator=gen)], 1)[:, order]
    v_pad = torch.cat([v, -1e30 * torch.randn(n, pad, kv_heads, dim, generator=gen)], 1)[:, order]
    positions_pad = torch.cat([key_positions, torch.full((n, pad), NO_KEY)], 1)[:, order]
    padded = causal_attention(q, k_pad, v_pad, q_positions, positions_pad)
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)

    later, earlier = k.clone(), k.clone()
    later[:, 6:] += 5.0  # after the first query's position 5
    earlier[:, 2] += 5.0
    changed_later = causal_attention(q, later, v, q_positions, key_positions)
    torch.testing.assert_close(changed_later[:, 0], plain[:, 0])
    assert not torch.allclose(causal_attention(q, earlier, v, q_positions, key_positions)[:, 0], plain[:, 0])
    if num_queries > 1:
        assert not torch.allclose(changed_later[:, -1], plain[:, -1])  # the last query saw the change


@pytest.mark.parametrize("start, num_queries, padding", [(0, 128, 0), (0, 200, 7), (96, 130, 16), (300, 256, 5)])
def test_a_prompt_chunk_in_two_unmasked_calls_equals_the_masked_attention(start, num_queries, padding):
    """`attend_prompt_chunk` (the keys before the chunk, then the chunk's own keys causally, merged by their
    log-sum-exps) gives what `attend` gives with the causal mask over the chunk's whole context: grouped-query
    heads, padding rows of huge garbage after the chunk ignored. Chunks below CHUNK_SPLIT_FROM_QUERIES queries keep
    the mask."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, end = 6, 2, 16, start + num_queries
    q = torch.randn(1, num_queries, heads, dim, generator=gen)
    k = torch.cat([torch.randn(1, end, kv_heads, dim, generator=gen), torch.full((1, padding, kv_heads, dim), 1e30)], 1)
    v = torch.cat([torch.randn(1, end, kv_heads, dim, generator=gen), torch.full((1, padding, kv_heads, dim), -1e30)], 1)
    key_positions = torch.cat([torch.arange(end), torch.full((padding,), NO_KEY)])[None]
    want = attend(q, k, v, causal_mask(torch.arange(start, end)[None], key_positions))
    torch.testing.assert_close(attend_prompt_chunk(q, k, v, start), want, rtol=1e-5, atol=1e-5)
    assert prompt_chunk_in_two_calls(torch.empty(1, CHUNK_SPLIT_FROM_QUERIES, heads, dim))
    assert not prompt_chunk_in_two_calls(torch.empty(1, CHUNK_SPLIT_FROM_QUERIES - 1, heads, dim))


def test_prompt_chunks_attended_unmasked_generate_what_transformers_does(tiny_llama, monkeypatch):
    """Prompts of 130-300 tokens under a step budget of 128 tokens, two calls from 128 queries (the tiny model's
    positions end at 512): the chunks of 128 queries attend by `attend_prompt_chunk` (the calls counted), the others
    by the mask, and greedy output equals transformers'."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import hf_greedy

    chunks = []

    def counted(q, k, v, start):
        chunks.append((start, q.shape[1]))
        return attend_prompt_chunk(q, k, v, start)

    monkeypatch.setattr(attention_policy, "attend_prompt_chunk", counted)
    monkeypatch.setattr(reference_attention, "CHUNK_SPLIT_FROM_QUERIES", 128)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (300, 130, 257)]
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB", chunk_size=128)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, prompt, 8) for prompt in prompts]
    assert {start for start, _ in chunks} >= {0, 128}  # a first chunk, and one after a context
    assert all(queries == 128 for _, queries in chunks)


# --- 3, 4: policies that read a subset ---------------------------------------------------------------------------


class DropOneKeyPerLayer(AttentionPolicy):
    """Layer l reads every cached key except column l + 1 (column 0 stays: every query sees a key)."""

    def __init__(self, storage: KVStorage):
        super().__init__(storage)
        self.selected: list[tuple[int, torch.Tensor]] = []  # (layer, kept columns) per attend call

    def select_keys(self, layer, group):
        columns = torch.tensor([c for c in range(group.keys.width) if c != layer + 1])
        columns = columns.expand(group.num_sequences, -1)
        self.selected.append((layer, columns[0]))
        return group.keys.take(columns)


def test_each_layer_attends_to_exactly_the_keys_its_policy_selected(tiny_llama, monkeypatch):
    """In a step of two decodes and a prefill chunk, a policy selecting a different subset per layer hands attention
    exactly those keys: K/V equal to what storage reads back for the sequence at the selected positions, and the
    causal mask of those positions (columns past a sequence's context are padding)."""
    engine = new_engine(tiny_llama)
    a, b, c = (probe(ids, i) for i, ids in enumerate(random_ids(3, 20, 35, 18)))
    prefill_and_sample(engine, [a, b])
    policy = DropOneKeyPerLayer(engine.kv_cache)
    use_policy(engine, policy)
    seen = []

    def spy(q, k, v, mask):
        seen.append((k.clone(), v.clone(), mask.clone()))
        return attend(q, k, v, mask)

    monkeypatch.setattr(attention_policy, "attend", spy)
    run_step(engine, [(c, 18), (a, 1), (b, 1)])  # the runner puts the decodes first
    assert [layer for layer, _ in policy.selected] == [0, 0, 1, 1, 2, 2]
    groups = [([a, b], torch.tensor([[20], [35]])), ([c], torch.arange(18)[None])] * NUM_LAYERS
    for (layer, columns), (k, v, mask), (seqs, q_positions) in zip(policy.selected, seen, groups, strict=True):
        assert layer + 1 not in columns.tolist() and k.shape[1] == len(columns)
        positions = []
        for row, seq in enumerate(seqs):
            context = seq.num_computed_tokens
            real = columns < context
            want_k, want_v = engine.kv_cache.read(layer, seq.block_table, context)
            assert torch.equal(k[row, real], want_k[columns[real]]), (layer, row)
            assert torch.equal(v[row, real], want_v[columns[real]]), (layer, row)
            positions.append(columns.masked_fill(~real, NO_KEY))
        assert torch.equal(mask, causal_mask(q_positions, torch.stack(positions)))


class LastWindow(AttentionPolicy):
    """Decodes attend to the last `last` cached tokens of their sequence; prefill chunks to every token (so it
    leaves the policy's `window`, which prompt chunks would obey too, unset)."""

    def __init__(self, storage: KVStorage, last: int):
        super().__init__(storage)
        self.last = last

    def select_keys(self, layer, group):
        if not group.is_decode:
            return group.keys
        lens = group.context_lens
        columns = lens[:, None] - self.last + torch.arange(self.last, device=lens.device)
        valid = columns >= 0
        return group.keys.take(columns.clamp(min=0), valid)


class HandWindow(AttentionPolicy):
    """The reference for LastWindow, with no keys, masks or gathers: a decode step of `seqs` (in that order) whose
    every row attends, by the textbook formula, to the last `window` K/V that `storage.read` gives back."""

    def __init__(self, storage: KVStorage, window: int, seqs: list[Sequence]):
        super().__init__(storage)
        self.window, self.seqs = window, seqs

    def attention(self, layer, q, k_new, v_new, batch):
        self.storage.store(layer, batch.slot_mapping, batch.positions, k_new, v_new)
        out = torch.empty_like(q)
        for row, seq in enumerate(self.seqs):
            context = seq.num_computed_tokens + 1
            k, v = self.storage.read(layer, seq.block_table, context)
            k, v = k[-self.window :], v[-self.window :]
            positions = torch.arange(context - len(k), context)
            out[row] = textbook_attention(q[row][None, None], k[None], v[None], torch.tensor([[context - 1]]),
                                          positions[None])[0, 0].to(q.dtype)
        return out


def test_last_window_with_a_wide_window_generates_what_full_attention_does(tiny_llama):
    """A window at least as long as every sequence reads every key: greedy outputs of prompts of different lengths,
    batched together, are those of full attention."""
    prompts = random_ids(4, 5, 37, 12, 64)
    full = LLM(str(tiny_llama), kv_cache_memory="2MiB", threads=1)
    windowed = LLM(str(tiny_llama), kv_cache_memory="2MiB", threads=1)
    use_policy(windowed.engine, LastWindow(windowed.engine.kv_cache, 80))
    expected = [o.token_ids for o in full.generate(prompts, greedy(10))]
    assert [o.token_ids for o in windowed.generate(prompts, greedy(10))] == expected


def test_last_window_decodes_read_only_the_last_w_keys(tiny_llama, monkeypatch):
    """With a window of 8, each decode row gathers exactly positions context-8 .. context-1 (padding where the
    sequence is shorter), and the decode logits equal a hand-computed attention over the last 8 K/V read back from
    storage: equal to full attention for sequences within the window, different for the longer one."""
    window = 8
    engine = new_engine(tiny_llama)
    seqs = [probe(ids, i) for i, ids in enumerate(random_ids(5, 3, 7, 40))]
    prefill_and_sample(engine, seqs)
    contexts = [seq.num_tokens for seq in seqs]  # 4, 8, 41 once the decode's token is written
    for seq in seqs:
        assert engine.kv_manager.grow(seq, 1)

    @torch.inference_mode()
    def decode_logits(policy: AttentionPolicy) -> torch.Tensor:
        use_policy(engine, policy)
        _, hidden = engine.runner.forward([(seq, 1) for seq in seqs])
        return engine.runner.model.compute_logits(hidden).float()

    full = decode_logits(engine.attention)
    by_hand = decode_logits(HandWindow(engine.kv_cache, window, seqs))
    gathered = []
    gather = engine.kv_cache.gather

    def spy(layer, slots, positions, dtype):
        gathered.append(positions.clone())
        return gather(layer, slots, positions, dtype)

    monkeypatch.setattr(engine.kv_cache, "gather", spy)
    windowed = decode_logits(LastWindow(engine.kv_cache, window))
    want = torch.tensor([[p if p >= 0 else NO_KEY for p in range(c - window, c)] for c in contexts])
    assert len(gathered) == NUM_LAYERS and all(torch.equal(p, want) for p in gathered)
    torch.testing.assert_close(windowed, by_hand, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(windowed[:2], full[:2], rtol=1e-4, atol=1e-4)
    assert (windowed[2] - full[2]).abs().max() > 1e-2


# --- 5, 6: step hooks --------------------------------------------------------------------------------------------


def record_hooks(engine: LLMEngine, monkeypatch) -> list:
    """Events of the engine's storage, in order: "begin", ("store", layer), "end"; "fused" where a step of decodes
    stores every layer's K/V inside the fused operator (kv/fused_decode.py) instead."""
    events = []
    storage = engine.kv_cache
    for name in ("begin_step", "end_step", "store", "fused_decode"):
        method = getattr(storage, name)

        def spy(*args, method=method, name=name):
            result = method(*args)
            if name == "store":
                events.append(("store", args[0]))
            elif name != "fused_decode" or result is not None:
                events.append(name.split("_")[0])
            return result

        monkeypatch.setattr(storage, name, spy)
    return events


def test_each_engine_step_begins_once_before_layer_0_and_ends_once_after_the_last(tiny_llama, monkeypatch):
    """Storage hears one begin_step, then every layer's store in order, then one end_step, in every engine step."""
    engine = new_engine(tiny_llama, chunk_size=32)
    events = record_hooks(engine, monkeypatch)
    for prompt in random_ids(6, 20, 45, 9):
        engine.add_request(prompt, greedy(4))
    layer_by_layer = ["begin", *(("store", layer) for layer in range(NUM_LAYERS)), "end"]
    fused = ["begin", "fused", "end"]
    steps = fused_steps = 0
    while engine.has_unfinished_requests():
        events.clear()
        engine.step()
        assert events in (layer_by_layer, fused)
        steps += 1
        fused_steps += events == fused
    assert steps > 4
    assert (fused_steps > 0) == (paged_decode.kernel() is not None)  # the last steps decode alone


def test_end_step_runs_when_a_layer_raises(tiny_llama, monkeypatch):
    """The runner ends the step even when the model fails half-way: storage gets its end_step after the failure."""
    engine = new_engine(tiny_llama)
    events = record_hooks(engine, monkeypatch)

    def broken(*args, **kwargs):
        events.append("raised")
        raise RuntimeError("layer 1 broke")

    monkeypatch.setattr(engine.runner.model.layers[1], "forward", broken)
    seq = probe(random_ids(7, 10)[0])
    assert engine.kv_manager.grow(seq, 10)
    with pytest.raises(RuntimeError, match="layer 1 broke"):
        engine.runner.forward([(seq, 10)])
    assert events == ["begin", ("store", 0), "raised", "end"]


def test_kivi_quantizes_blocks_leaving_the_window_in_begin_step(tiny_llama_kv64, monkeypatch):
    """KIVI decides which blocks leave the float16 window in begin_step: a block complete before the step (here
    block 0, in the decode step whose context reaches residual + one block) is quantized there in every layer and
    its window slot freed before layer 0 stores, and after the step nothing is pending."""
    engine = new_engine(tiny_llama_kv64, kv_format="kivi4", kivi_residual=32, chunk_size=32, max_num_seqs=4,
                        kv_cache_memory="8MiB")
    cache = engine.kv_cache
    block_0_slot_at_store = []
    store = cache.store

    def spy(layer, *args):
        block_0_slot_at_store.append(int(cache.window_slot[seq.block_table[0]]))
        return store(layer, *args)

    monkeypatch.setattr(cache, "store", spy)
    request = engine.add_request(random_ids(8, 40)[0], greedy(12))
    seq = engine._sequences[request]
    left_in = []
    while engine.has_unfinished_requests():
        block_0_slot_at_store.clear()
        slot_0 = int(cache.window_slot[seq.block_table[0]]) if seq.block_table else None
        engine.step()
        assert cache._writes is None
        if slot_0 is not None and slot_0 >= 0 and block_0_slot_at_store[0] == -1:
            assert block_0_slot_at_store == [-1] * NUM_LAYERS and slot_0 in cache.free_slots
            left_in.append(seq.num_computed_tokens)
    assert left_in == [48]  # the step whose context reaches residual + one block


def test_a_failed_kivi_step_leaves_the_prefix_cache_usable(tiny_llama_kv64, monkeypatch):
    """A step that fails half-way through its layers (the engine fails its requests and goes on) must not leave
    corrupt blocks in the prefix cache: the same prompt, asked again and sharing the cached blocks, generates what an
    engine that never failed does. Here the failing step is the one in which block 0 leaves the float16 window."""
    options = {"kv_format": "kivi4", "kivi_residual": 32, "chunk_size": 32, "kv_cache_memory": "8MiB"}
    prompt = random_ids(8, 40)[0]
    expected = run_all(new_engine(tiny_llama_kv64, **options), [prompt], greedy(12))[0].output_token_ids

    engine = new_engine(tiny_llama_kv64, **options)
    request = engine.add_request(prompt, greedy(12))
    seq = engine._sequences[request]
    while seq.num_computed_tokens < 47:  # the next step writes token 47: context 48, block 0 leaves the window
        engine.step()

    def broken(*args, **kwargs):
        raise RuntimeError("layer 1 broke")

    with monkeypatch.context() as patch:
        patch.setattr(engine.runner.model.layers[1], "forward", broken)
        failed = engine.step()  # the step's requests end with an error, the engine goes on
    assert [o.finish_reason for o in failed] == ["error"] and "layer 1 broke" in failed[0].error
    again = run_all(engine, [prompt], greedy(12))[0]
    assert again.num_cached_prompt_tokens == 32
    assert again.output_token_ids == expected


# --- 7: eviction listeners ---------------------------------------------------------------------------------------


def test_block_pool_tells_listeners_of_cached_blocks_it_reuses():
    """A listener hears (block, hash) once, when a registered block is handed out again, while the hash is still
    indexed; never for blocks that held nothing cached."""
    pool = BlockPool(2)
    heard = []
    pool.eviction_listeners.append(lambda block, block_hash: heard.append((block, block_hash,
                                                                           pool.lookup(block_hash))))
    cached = pool.allocate()
    pool.register(cached, b"h")
    pool.release(cached)
    other = pool.allocate()  # the never-registered block goes first
    assert other != cached and heard == []
    assert pool.allocate() == cached
    assert heard == [(cached, b"h", cached)] and pool.lookup(b"h") is None
    pool.release(cached)
    pool.release(other)
    pool.allocate(), pool.allocate()
    assert len(heard) == 1


def test_eviction_listener_sees_the_evicted_prefix_intact(tiny_llama):
    """In an engine of 4 blocks, later prompts must take blocks that cache earlier prompts: the listener is called
    with (block, hash) for exactly the hashes that leave the pool's index, and at call time storage still holds
    that block's K/V as they were when it was cached."""
    engine = new_engine(tiny_llama, kv_cache_memory=4 * BLOCK_BYTES, max_model_len=64)
    pool = engine.kv_manager.pool
    assert pool.num_blocks == 4

    def block_kv(block: int) -> torch.Tensor:
        return torch.stack([torch.stack(engine.kv_cache.read(layer, [block], BLOCK_SIZE))
                            for layer in range(NUM_LAYERS)])

    heard = []
    pool.eviction_listeners.append(lambda block, h: heard.append((block, h, pool.lookup(h), block_kv(block))))
    first, second = random_ids(9, 40, 40)
    rounds = [first, second, first[:16] + second[:20]]  # the last one shares block 0 of the first
    cached_tokens = []
    for prompt in rounds:
        before = dict(pool.block_of_hash)
        contents = {block: block_kv(block) for block in before.values()}
        heard.clear()
        cached_tokens.append(run_all(engine, [prompt], greedy(4))[0].num_cached_prompt_tokens)
        evicted = {h: b for h, b in before.items() if pool.block_of_hash.get(h) != b}
        assert sorted((block, h) for block, h, _, _ in heard) == sorted((b, h) for h, b in evicted.items())
        for block, _, indexed, kv in heard:
            assert indexed == block  # still indexed while the listener runs
            assert torch.equal(kv, contents[block])
        if prompt is not first:
            assert heard  # every later round had to evict
    assert cached_tokens == [0, 0, 16]


# --- 8: KV loaded one layer at a time -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefix_and_kv(tiny_llama):
    """A 50-token prefix (3 full blocks) and its K/V as another engine on the same weights computes them."""
    prefix = random_ids(10, 50)[0]
    return prefix, new_engine(tiny_llama).compute_kv(prefix)


def test_layerwise_preloaded_kv_is_loaded_one_layer_at_a_time(tiny_llama, prefix_and_kv):
    """KV whose layers are loaded on demand is placed layer after layer, each layer loaded once, in order, and
    generates what the same KV at hand does; a layer of the wrong shape is refused with a clear error."""
    prefix, (k, v) = prefix_and_kv
    prompt = prefix + random_ids(11, 10)[0]
    engine = new_engine(tiny_llama)
    expected = run_all(engine, [prompt], greedy(6))[0].output_token_ids
    loaded = []

    def load(layer):
        loaded.append(layer)
        return k[layer], v[layer]

    engine = new_engine(tiny_llama)
    lazy = LayerwiseKV(0, k.shape[1], load, tuple(k.shape[2:]))
    engine.add_request(prompt, greedy(6), preloaded=[lazy], cache_salt=b"lazy")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert loaded == list(range(k.shape[0]))
    assert outputs[0].token_ids == expected

    engine = new_engine(tiny_llama)
    bad = LayerwiseKV(0, k.shape[1], lambda layer: (k[layer, :, :1], v[layer, :, :1]), tuple(k.shape[2:]))
    with pytest.raises(KvstrataError, match=r"layer 0 of preloaded KV has K"):
        engine.kv_cache.write(list(range(4)), bad, 0, 16)


# --- 9, 10: namespaced hashes, the format registry ---------------------------------------------------------------


def test_block_hashes_are_namespaced_by_weights_and_stored_form(tiny_llama, tiny_llama_kv64):
    """The same prompt hashes alike in two engines of the same weights and format, differently under another
    format (fp32 vs int8) or other weights."""
    prompt = random_ids(13, 40)[0]

    def hashes(model, **options) -> list[bytes]:
        manager = new_engine(model, max_model_len=64, **options).kv_manager
        seq = probe(prompt)
        manager.match_prefix(seq)
        manager.free(seq)
        assert len(seq.block_hashes) == 2
        return seq.block_hashes

    fp32 = hashes(tiny_llama, kv_format="fp32")
    assert hashes(tiny_llama, kv_format="fp32") == fp32
    assert hashes(tiny_llama) == fp32  # the default format of float32 weights is fp32
    for other in (hashes(tiny_llama, kv_format="int8"), hashes(tiny_llama_kv64, kv_format="fp32")):
        assert all(a != b for a, b in zip(other, fp32, strict=True))


def test_stored_form_names_exactly_the_options_that_change_stored_bytes():
    """int4's group size is part of int4's stored form, not of other formats'; Oaken's options are part of Oaken's,
    KIVI's residual (which blocks hold float16) of KIVI's; the dtype the K/V were computed in is part of every one."""

    def form(**options) -> str:
        return stored_form(EngineConfig(**options), torch.float32)

    assert form(kv_format="int4", int4_group_size=32) != form(kv_format="int4", int4_group_size=64)
    assert form(kv_format="int8", int4_group_size=32) == form(kv_format="int8", int4_group_size=64)
    assert form(kv_format="fp32", int4_group_size=32) == form(kv_format=None) == "fp32@fp32"
    assert form(kv_format="oaken", oaken_outliers="fp16") != form(kv_format="oaken")
    assert form(kv_format="int8", oaken_outliers="fp16") == form(kv_format="int8")
    assert form(kv_format="kivi4", kivi_residual=32) != form(kv_format="kivi4", kivi_residual=128)
    assert form(kv_format="int8", kivi_residual=32) == form(kv_format="int8", kivi_residual=128)
    assert stored_form(EngineConfig(), torch.bfloat16) == "bf16@bf16"
    assert stored_form(EngineConfig(kv_format="bf16"), torch.float32) != stored_form(EngineConfig(), torch.bfloat16)
    # K and V in two formats: int4's groups where either side is int4; the sides' order matters
    assert form(kv_format="int8/int4", int4_group_size=32) != form(kv_format="int8/int4", int4_group_size=64)
    assert form(kv_format="int8/fp8", int4_group_size=32) == form(kv_format="int8/fp8", int4_group_size=64)
    assert form(kv_format="int8/int4") != form(kv_format="int4/int8")
    assert form(kv_format="int8/int8") == form(kv_format="int8")  # one format for both is that format


def test_the_format_registry_is_the_one_list_of_formats():
    """Every format the configuration accepts is in the registry; an unknown name is refused, named, with the
    allowed ones listed, by the registry and by EngineConfig."""
    assert set(KV_FORMATS) == set(cache_factory.KV_FORMATS)
    shape = CacheShape(num_layers=2, num_kv_heads=2, head_dim=32, block_size=BLOCK_SIZE)
    with pytest.raises(KvstrataError, match="int3") as raised:
        storage_layout("int3", shape, FormatOptions())
    assert all(name in str(raised.value) for name in cache_factory.KV_FORMATS)
    with pytest.raises(KvstrataError, match="int3"):
        EngineConfig(kv_format="int3")


def test_vllms_kv_cache_dtype_names_a_kv_format():
    """vLLM's --kv-cache-dtype is read into kv_format and cleared, so that a copy of the config given another
    kv_format keeps that one (as the full-precision twin Oaken calibrates on needs); a value vLLM has and kvstrata
    not, or one that contradicts kv_format, is refused by name."""
    assert EngineConfig(kv_cache_dtype="fp8").kv_format == EngineConfig(kv_cache_dtype="fp8_e4m3").kv_format == "fp8"
    assert EngineConfig(kv_cache_dtype="fp8_e5m2").kv_format == "fp8_e5m2"
    assert EngineConfig(kv_cache_dtype="bfloat16").kv_format == "bf16"
    assert EngineConfig(kv_cache_dtype="auto").kv_format is None
    assert EngineConfig(kv_cache_dtype="auto", kv_format="int4").kv_format == "int4"
    assert EngineConfig(kv_cache_dtype="fp8", kv_format="fp8").kv_format == "fp8"
    assert dataclasses.replace(EngineConfig(kv_cache_dtype="fp8"), kv_format=None).kv_format is None
    with pytest.raises(KvstrataError, match="kv_cache_dtype 'fp8_inc' is not one of auto, bfloat16, fp8"):
        EngineConfig(kv_cache_dtype="fp8_inc")
    with pytest.raises(KvstrataError, match=r"kv_cache_dtype 'fp8' \(kv_format fp8\) and kv_format 'int8' disagree"):
        EngineConfig(kv_cache_dtype="fp8", kv_format="int8")


@pytest.mark.parametrize(("name", "refused"), [("int8/oaken", "V's format 'oaken'"), ("fp16/int4", "K's format 'fp16'"),
                                               ("int8/", "V's format ''"), ("int8/int4/fp8", "V's format 'int4/fp8'")])
def test_k_and_v_formats_are_two_record_formats(name, refused):
    """KEYS/VALUES takes two of the record formats; any other side is refused, named, with the allowed ones."""
    with pytest.raises(KvstrataError, match=f"kv_format '{name}': {refused} is not one of int8, int4, fp8, fp8_e5m2"):
        EngineConfig(kv_format=name)


def test_a_split_layout_charges_each_sides_record():
    shape = CacheShape(num_layers=2, num_kv_heads=2, head_dim=32, block_size=BLOCK_SIZE)
    split = storage_layout("int8/int4", shape, FormatOptions(int4_group_size=32))
    assert split.bytes_per_token == 2 * ((64 + 2) + (32 + 2 * 4))  # layers x (int8's record + int4's)
    assert EngineConfig(kv_format="fp8/fp8").kv_format == "fp8"  # one format for both is that format


@pytest.mark.parametrize("name", [*(n for n in cache_factory.KV_FORMATS if n != "oaken"), "int8/int4", "fp8/int8"])
def test_every_registered_format_stores_and_gathers_by_slot(name):
    """Each registered layout builds a KVStorage that gives back, by slot, close to what was stored."""
    shape = CacheShape(num_layers=2, num_kv_heads=2, head_dim=32, block_size=BLOCK_SIZE)
    layout = storage_layout(name, shape, FormatOptions(chunk_size=32))
    storage = layout.build(32, torch.device("cpu"))
    assert isinstance(storage, KVStorage)
    pool = GroupedBlockPool(32, layout.block_group)  # KIVI's window borrows groups of blocks that no one holds
    storage.attach_block_pool(pool)
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    storage.reset_blocks([0, 1, 2, 3])
    gen = torch.Generator().manual_seed(14)
    k, v = torch.randn(2, 20, 2, 32, generator=gen), torch.randn(2, 20, 2, 32, generator=gen)
    table = [2, 0]  # tokens 0-15 in block 2, 16-19 in block 0
    storage.write(table, PreloadedKV(0, k, v), 0, 20)
    # int4: 16 steps over a group's range; fp8 (e4m3fn, e5m2): 1/16 (1/8) of a value at most; KIVI: 20 tokens lie
    # in the float16 window of 128
    tolerance = {"fp32": 0, "fp16": 2e-3, "bf16": 2e-2, "int8": 5e-2, "int4": 0.3, "fp8": 0.3, "fp8_e5m2": 0.6,
                 "int8/int4": 0.3, "fp8/int8": 0.3}.get(name, 2e-3)
    for layer in range(2):
        got_k, got_v = storage.read(layer, table, 20)
        assert (got_k - k[layer]).abs().max() <= tolerance and (got_v - v[layer]).abs().max() <= tolerance


# --- 11: what kv/ may import, where commands are registered ------------------------------------------------------

PACKAGE = Path(kvstrata.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports statically (inside functions and TYPE_CHECKING blocks too), relative imports
    resolved."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_kv_imports_nothing_above_it():
    """No module under kvstrata/kv imports the engine, the CLI, benchmarks, the server, evaluations or the LLM
    front end."""
    above = ("kvstrata.engine", "kvstrata.cli", "kvstrata.bench", "kvstrata.server", "kvstrata.eval", "kvstrata.llm")
    files = sorted((PACKAGE / "kv").rglob("*.py"))
    assert len(files) > 20
    offending = {str(path.relative_to(PACKAGE)): sorted(m for m in imported_modules(path)
                                                         if m == "kvstrata" or m.startswith(above))
                 for path in files}
    assert {path: modules for path, modules in offending.items() if modules} == {}


def test_cli_commands_are_registered_only_under_cli():
    """Every argparse subcommand (`add_parser(`) is registered in kvstrata/cli/."""
    registering = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_parser":
                registering.add(path.relative_to(PACKAGE).as_posix())
    assert "cli/main.py" in registering
    assert sorted(p for p in registering if not p.startswith("cli/")) == []


# --- 12: persistent block tables ---------------------------------------------------------------------------------


def test_block_tables_rewrite_the_entries_given_back_behind_a_window():
    """Entries a sequence gave back (KVCacheManager.release_behind_window) and the columns past its blocks repeat
    the first block it still holds."""
    tables = BlockTables(max_blocks_per_seq=5, rows=1)
    a = SimpleNamespace(num_released_blocks=0, block_table=[4, 7, 8])
    tables.rows_for([a])
    a.block_table[:2] = [8, 8]
    a.num_released_blocks = 2
    a.block_table.append(9)
    tables.rows_for([a])
    assert tables.table[0].tolist() == [8, 8, 8, 9, 8]


def test_block_tables_keep_rows_write_only_new_blocks_and_recycle_rows():
    """A sequence keeps its row across calls and only blocks it gained are written; columns past its blocks repeat
    its first block; a replaced block list (preemption) rewrites the row; more sequences than rows grow the table;
    rows of sequences absent from a call are taken back least recently used first."""
    tables = BlockTables(max_blocks_per_seq=5, rows=2)
    a, b = SimpleNamespace(num_released_blocks=0, block_table=[4, 7]), SimpleNamespace(num_released_blocks=0, block_table=[9])
    assert tables.rows_for([a, b]).tolist() == [0, 1]
    assert tables.table[:2].tolist() == [[4, 7, 4, 4, 4], [9, 9, 9, 9, 9]]

    tables.table[0, 0] = 99  # a marker: rewriting the row would overwrite it
    a.block_table.append(8)
    assert tables.rows_for([b, a]).tolist() == [1, 0]
    assert tables.table[0].tolist() == [99, 7, 8, 4, 4]

    a.block_table = [3]  # freed and readmitted: a new list
    assert tables.rows_for([a]).tolist() == [0]
    assert tables.table[0].tolist() == [3, 3, 3, 3, 3]

    c = SimpleNamespace(num_released_blocks=0, block_table=[5, 6])
    rows = tables.rows_for([a, b, c]).tolist()
    assert len(set(rows)) == 3 and len(tables.table) >= 3
    assert [tables.table[r, :2].tolist() for r in rows] == [[3, 3], [9, 9], [5, 6]]

    fillers = [SimpleNamespace(num_released_blocks=0, block_table=[20 + i]) for i in range(len(tables.table) - 3)]  # kept alive: rows are
    for filler in fillers:  # keyed by id(); they use up every row
        tables.rows_for([filler])
    assert tables.rows_for([a])[0] == rows[0]  # a is now the most recent; b, then c, the least recent
    d = SimpleNamespace(num_released_blocks=0, block_table=[1, 2])
    row_d = tables.rows_for([d])[0]
    assert row_d == rows[1]  # b's row went to d
    assert tables.table[row_d].tolist() == [1, 2, 1, 1, 1]
    row_b = tables.rows_for([b])[0]  # b comes back to c's row, rewritten
    assert row_b == rows[2] and tables.table[row_b].tolist() == [9, 9, 9, 9, 9]
