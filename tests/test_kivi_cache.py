"""KIVI in the paged cache (kv/kivi_cache.py): 2- and 4-bit packing, layer 0's K/V bit for bit against KIVI's
quantization of the full-precision cache, blocks leaving the float16 window as sequences grow, the engine with
kivi4/kivi2 (prefix sharing, preemption, blocks per budget) and a saved CacheGen context placed into it."""

import math
import random

import pytest
import torch

from kvstrata import LLM, SamplingParams
from kvstrata.cachegen.context import SavedContext
from kvstrata.config import EngineConfig
from kvstrata.engine.kv_setup import engine_storage_layout
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sequence import Sequence
from kvstrata.errors import KvstrataError
from kvstrata.kv import attention_policy
from kvstrata.kv.attention_batch import whole_block_keys
from kvstrata.kv.block_groups import GroupedBlockPool
from kvstrata.kv.formats.asymmetric import dequantize_asymmetric, quantize_asymmetric
from kvstrata.kv.formats.nibbles import pack_codes, pack_nibbles, unpack_codes, unpack_nibbles
from kvstrata.kv.kivi_cache import KiviPagedKVCache
from kvstrata.kv.reference_attention import attend
from tests.helpers import prefill_in_chunks

KIVI = ("kivi4", "kivi2")
BITS = {"kivi4": 4, "kivi2": 2}
BLOCK_SIZE = 16
RESIDUAL = 32
CHUNK_SIZE = 32
MAX_SEQS = 4
NUM_LAYERS, WIDTH = 3, 64  # the tiny Llama below: 4 KV heads x 16
WINDOW_BLOCKS = -(-RESIDUAL // BLOCK_SIZE) + 1  # most float16 blocks a sequence holds after a step
# and one more for a sequence writing 33+ tokens in a step (here at most one: chunks of 32, or a context written)
STEP_SLOTS = 1
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# --- packing ------------------------------------------------------------------------------------------------------


def test_pack_codes_puts_each_code_at_its_bits():
    codes = torch.tensor([[1, 2, 3, 0, 3, 3, 0, 1]], dtype=torch.uint8)
    # 2 bits: code i in byte i // 4 at bit 2 * (i % 4), the first code lowest
    assert pack_codes(codes, 2).tolist() == [[0b00_11_10_01, 0b01_00_11_11]]
    # 4 bits: code i in byte i // 2, the even code in the low nibble
    assert pack_codes(codes, 4).tolist() == [[0x21, 0x03, 0x33, 0x10]]
    two_bit = torch.tensor([[0b00_11_10_01, 0b01_00_11_11]], dtype=torch.uint8)
    assert unpack_codes(two_bit, 2).tolist() == codes.tolist()
    assert unpack_codes(torch.tensor([[0xA1, 0x3F]], dtype=torch.uint8), 4).tolist() == [[0x1, 0xA, 0xF, 0x3]]


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_codes_round_trips(bits):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (37, 96), generator=gen, dtype=torch.uint8)
    codes[0] = 2**bits - 1  # the largest code everywhere, and the smallest
    codes[1] = 0
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (37, 96 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)
    assert torch.equal(pack_codes(codes.long(), bits), packed)  # any integer dtype in
    if bits == 4:
        assert torch.equal(pack_nibbles(codes), packed) and torch.equal(unpack_nibbles(packed), codes)


# --- engines ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp_engine(tiny_llama_kv64):
    return LLMEngine(EngineConfig(model=str(tiny_llama_kv64), kv_cache_memory="8MiB", threads=1))


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (37, 64, 90, 21, 48)]


def make_llm(tiny_llama_kv64, kv_format, **options) -> LLM:
    options = {"kv_cache_memory": "8MiB", "threads": 1, "chunk_size": CHUNK_SIZE, "max_num_seqs": MAX_SEQS,
               "kivi_residual": RESIDUAL, **options}
    return LLM(str(tiny_llama_kv64), kv_format=kv_format, **options)


def kivi_of(k: torch.Tensor, v: torch.Tensor, bits: int, num_quantized: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What KIVI makes of K and V [n, width]: every value rounded to float16; the first `num_quantized` tokens (whole
    blocks) quantized, keys per channel over each block's tokens, values per token in groups of 32 channels."""
    k, v = k.half().float(), v.half().float()
    width = k.shape[1]
    want_k, want_v = k.clone(), v.clone()
    if num_quantized:
        blocks = k[:num_quantized].reshape(-1, BLOCK_SIZE, width)
        codes, params = quantize_asymmetric(blocks, 1, bits)
        want_k[:num_quantized] = dequantize_asymmetric(codes, params.float(), 1).reshape(num_quantized, width)
        groups = v[:num_quantized].reshape(num_quantized, width // 32, 32)
        codes, params = quantize_asymmetric(groups, 2, bits)
        want_v[:num_quantized] = dequantize_asymmetric(codes, params.float(), 2).reshape(num_quantized, width)
    return want_k, want_v


def quantized_tokens(context_len: int) -> int:
    """Tokens in the blocks that lie wholly before a sequence's newest RESIDUAL tokens."""
    return max(context_len - RESIDUAL, 0) // BLOCK_SIZE * BLOCK_SIZE


# --- layer 0 against the full-precision cache ------------------------------------------------------------------------


@pytest.mark.parametrize("store", ["compiled", "torch"])
@pytest.mark.parametrize("chunk", [24, 100])
@pytest.mark.parametrize("kv_format", KIVI)
def test_layer_0_holds_kivis_quantization_of_the_full_precision_cache(kv_format, chunk, store, tiny_llama_kv64,
                                                                      fp_engine, prompts):
    """Layer 0's K/V do not depend on the cache, so KIVI's layer 0 must hold exactly KIVI's quantization of what a
    full-precision engine stores: blocks wholly before the newest RESIDUAL tokens quantized, the rest float16. With
    chunks of 24, blocks straddle chunks and leave the window in different steps; with chunks of 100, blocks leave
    it in the step that fills them. Both window writers: the compiled one (kv/kernels/kivi_window_store.cpp) and
    torch's."""
    token_ids = (prompts[2] + prompts[0])[:100]
    n = len(token_ids)
    _, seq = prefill_in_chunks(fp_engine, token_ids, chunk)
    k_full, v_full = fp_engine.kv_cache.read(0, seq.block_table, n)
    fp_engine.kv_manager.free(seq)

    engine = make_llm(tiny_llama_kv64, kv_format).engine
    cache = engine.kv_cache
    assert isinstance(cache, KiviPagedKVCache) and cache.bits == BITS[kv_format] and cache.value_group == 32
    if store == "torch":
        cache.store_kernel = None
    elif cache.store_kernel is None:
        pytest.skip("no C++ compiler: the kernels could not be built")
    _, seq = prefill_in_chunks(engine, token_ids, chunk)
    quantized = quantized_tokens(n)  # 64: blocks 0-3; tokens 64-99 (blocks 4-6) stay float16
    assert quantized == 64
    slots = cache.window_slot[seq.block_table]
    assert (slots[: quantized // BLOCK_SIZE] == -1).all() and (slots[quantized // BLOCK_SIZE :] >= 0).all()
    k_got, v_got = cache.read(0, seq.block_table, n)
    want_k, want_v = kivi_of(k_full.reshape(n, -1), v_full.reshape(n, -1), BITS[kv_format], quantized)
    for got, want, full in ((k_got, want_k, k_full), (v_got, want_v, v_full)):
        got = got.reshape(n, -1)
        assert got.dtype == torch.float32
        assert torch.equal(got, want)
        assert torch.equal(got[quantized:], full.reshape(n, -1)[quantized:].half().float())
        assert not torch.equal(got[:quantized], full.reshape(n, -1)[:quantized].half().float())  # it was quantized
    engine.kv_manager.free(seq)


@pytest.mark.parametrize("kv_format", KIVI)
def test_every_layer_attends_to_what_the_cache_holds_after_the_step(kv_format, tiny_llama_kv64, monkeypatch):
    """A block leaves the window in one step for every layer: each layer's attention in that step already reads it
    quantized (the K/V it is given equal what the cache reads back after the step), here over chunks of 24 in which
    blocks leave, some of them while their last tokens are being written."""
    seen = []

    def spy(q, k, v, mask):
        seen.append((k.clone(), v.clone()))
        return attend(q, k, v, mask)

    monkeypatch.setattr(attention_policy, "attend", spy)
    engine = make_llm(tiny_llama_kv64, kv_format).engine
    cache = engine.kv_cache
    token_ids = torch.randint(3, 320, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    seq = Sequence(seq_id=1, request_id="probe", prompt=None, prompt_token_ids=token_ids, params=SamplingParams())
    quantized_blocks = []
    with torch.inference_mode():
        while seq.num_pending_tokens:
            n = min(24, seq.num_pending_tokens)
            assert engine.kv_manager.grow(seq, n)
            seen.clear()
            engine.runner.forward([(seq, n)])
            seq.num_computed_tokens += n
            context_len = seq.num_computed_tokens
            assert len(seen) == NUM_LAYERS
            for layer, (k, v) in enumerate(seen):
                want_k, want_v = cache.read(layer, seq.block_table, context_len)
                # the keys read are whole blocks: past the context, a block's unwritten tail (masked out)
                assert torch.equal(k[0, :context_len], want_k) and torch.equal(v[0, :context_len], want_v), \
                    (context_len, layer)
            quantized_blocks.append(int((cache.window_slot[seq.block_table] == -1).sum()))
    assert quantized_blocks == [0, 1, 2, 4, 4]  # after 24, 48, 72, 96 and 100 tokens
    engine.kv_manager.free(seq)


# --- the window as sequences grow ---------------------------------------------------------------------------------


def check_window(engine: LLMEngine) -> None:
    """Every running sequence's blocks wholly before its newest RESIDUAL tokens are quantized, the others are in the
    window (at most WINDOW_BLOCKS of them); every window slot is a group the pool lends, held by one block or free,
    and no sequence holds a block of a lent group (its codes are the slot's float16 rows)."""
    cache, pool = engine.kv_cache, engine.kv_manager.pool
    lent_blocks = {g * cache.group_size + i for g in pool.lent for i in range(cache.group_size)}
    for seq in engine.scheduler.running:
        table = torch.tensor(seq.block_table, dtype=torch.long)
        old = quantized_tokens(seq.num_computed_tokens) // BLOCK_SIZE
        assert (cache.window_slot[table[:old]] == -1).all(), seq.request_id
        assert (cache.window_slot[table[old:]] >= 0).all(), seq.request_id
        assert len(table) - old <= WINDOW_BLOCKS
        assert not lent_blocks & set(seq.block_table)
    held = cache.window_slot[cache.window_slot >= 0].tolist()
    assert sorted(held + cache.free_slots) == sorted(pool.lent)


@pytest.mark.parametrize("kv_format", KIVI)
def test_blocks_leave_the_window_as_sequences_decode(kv_format, tiny_llama_kv64):
    llm = make_llm(tiny_llama_kv64, kv_format)
    engine, cache, pool = llm.engine, llm.engine.kv_cache, llm.engine.kv_manager.pool
    most_slots = MAX_SEQS * WINDOW_BLOCKS + STEP_SLOTS  # 13
    assert not pool.lent and not cache.free_slots  # nothing lent before a sequence asks
    gen = torch.Generator().manual_seed(11)
    lengths = (100, 70, 45, 90)  # MAX_SEQS sequences at once
    ids = [engine.add_request(torch.randint(3, 320, (n,), generator=gen).tolist(), greedy(40)) for n in lengths]
    handed_out = []
    zero_blocks = engine.kv_manager.on_allocate
    engine.kv_manager.on_allocate = lambda blocks: (handed_out.extend(blocks), zero_blocks(blocks))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        assert len(engine.scheduler.running) <= MAX_SEQS
        check_window(engine)
        assert len(pool.lent) <= most_slots
    assert all(len(finished[i].token_ids) == 40 for i in ids)
    # 31 blocks went through at most 13 window slots: the slots of blocks that left came back and were handed out
    assert len(handed_out) == sum(-(-(n + 39) // BLOCK_SIZE) for n in lengths) == 31 > most_slots
    assert pool.num_used == len(pool.lent) * cache.group_size  # the lent groups alone


@pytest.mark.parametrize("kv_format", KIVI)
def test_long_chunks_quantize_their_leaving_blocks_without_window_slots(kv_format, tiny_llama_kv64):
    """Chunks of 100 tokens fill blocks that leave the window in the same step: they are quantized straight from the
    step's K/V, so two sequences run in at most 10 slots (3 each, and one per sequence that completes a leaving
    block in a step: at most 4 in a step of 100 tokens). Had every written block taken a slot, one chunk alone
    would need 7. (What the quantized blocks hold: the layer-0 test.)"""
    llm = make_llm(tiny_llama_kv64, kv_format, chunk_size=100, max_num_seqs=2)
    cache, pool = llm.engine.kv_cache, llm.engine.kv_manager.pool
    assert cache.slots_a_step_adds == 4
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (230, 75, 180, 140)]
    engine = llm.engine
    ids = [engine.add_request(prompt, greedy(20)) for prompt in prompts]
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        check_window(engine)
        assert len(pool.lent) <= 2 * WINDOW_BLOCKS + 4
    assert [len(finished[i].token_ids) for i in ids] == [20] * 4


def test_finished_sequences_keep_their_window_slots_while_blocks_are_to_spare(tiny_llama_kv64):
    """A finished sequence's newest blocks keep their float16 slots while the pool has blocks to spare, so a prompt
    sharing them reads them as their own sequence did; when the pool runs short, those slots go back to it and the
    blocks leave the prefix cache (recomputed if asked for again), never read quantized before their time."""
    llm = make_llm(tiny_llama_kv64, "kivi4", max_num_seqs=2)
    cache, pool = llm.engine.kv_cache, llm.engine.kv_manager.pool
    prompt = torch.randint(3, 320, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    first = llm.generate([prompt], greedy(8))[0]  # 78 tokens: blocks 0-1 quantized, blocks 2-4 in the window
    idle = (cache.window_slot >= 0).nonzero().flatten().tolist()
    assert len(idle) == 3 and all(pool.ref_counts[b] == 0 for b in idle)
    again = llm.generate([prompt + first.token_ids[:1]], greedy(8))[0]
    assert again.num_cached_tokens == 64 and again.token_ids[:7] == first.token_ids[1:]

    idle = (cache.window_slot >= 0).nonzero().flatten().tolist()
    cached = [b for b in idle if pool.hash_of_block[b] is not None]
    assert cached and all(pool.ref_counts[b] == 0 for b in idle)
    assert cache.reserve(0, keep_free=pool.num_blocks)  # the pool short of blocks: idle slots go back
    assert (cache.window_slot < 0).all() and len(pool.lent) == cache.slots_a_step_adds
    assert all(pool.hash_of_block[b] is None for b in cached)
    third = llm.generate([prompt + first.token_ids[:1]], greedy(8))[0]
    assert third.num_cached_tokens == 32 and third.token_ids == again.token_ids  # blocks 0-1, still quantized


# --- the engine ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_format", KIVI)
def test_greedy_generation_and_prefix_sharing(kv_format, tiny_llama_kv64, prompts):
    llm = make_llm(tiny_llama_kv64, kv_format)
    outputs = llm.generate(prompts, GREEDY)
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" and o.text for o in outputs)
    pool = llm.engine.kv_manager.pool
    assert pool.num_used == len(pool.lent) * llm.engine.kv_cache.group_size  # finished: only the window's groups

    # KIVI quantizes a block in place once it leaves its sequence's window, so a later request sharing it sees the
    # quantized block; the first request stops (92 + 3 tokens) before block 3 leaves, so the shared blocks are in the
    # state they would be in had the second request computed them itself.
    llm = make_llm(tiny_llama_kv64, kv_format)
    prefix = prompts[2]  # 90 tokens: 5 full blocks
    first = llm.generate([prefix + [10, 11]], greedy(4))[0]
    second = llm.generate([prefix + [12]], GREEDY)[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 80)
    unshared = make_llm(tiny_llama_kv64, kv_format, enable_prefix_caching=False).generate([prefix + [12]], GREEDY)[0]
    assert unshared.num_cached_tokens == 0
    assert second.token_ids == unshared.token_ids


@pytest.mark.parametrize("kv_format", KIVI)
def test_preemption_gives_the_same_outputs(kv_format, tiny_llama_kv64):
    """KIVI's output depends on the step in which each block leaves the window (that step's attention already reads
    it quantized), and SARATHI's chunks depend on what else runs; so this compares whole-prompt prefills
    (prefill-first) of prompts whose set of quantized blocks does not change while they generate: a recomputed
    sequence then sees exactly the cache it saw the first time."""
    gen = torch.Generator().manual_seed(7)
    lengths = (48, 64, 32, 48, 64, 16)  # whole blocks: a decode needs a new block at once
    for n in lengths:
        assert quantized_tokens(n) == quantized_tokens(n + GREEDY.max_tokens - 1)
    batch = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in lengths]
    roomy = make_llm(tiny_llama_kv64, kv_format, scheduler="prefill-first", max_model_len=128)
    expected = [o.token_ids for o in roomy.generate(batch, GREEDY)]
    assert sum(s.num_preempted for s in roomy.engine.step_stats) == 0

    layout = engine_storage_layout(roomy.engine, torch.float32, kv_format)
    block_bytes = math.ceil(BLOCK_SIZE * layout.bytes_per_token)
    # room for the first two or three requests and their windows, whose first decodes then need a block more than
    # is free (each lent slot takes 16 / bits blocks)
    blocks = {"kivi4": 48, "kivi2": 64}[kv_format]
    cramped = make_llm(tiny_llama_kv64, kv_format, scheduler="prefill-first", max_model_len=128,
                       kv_cache_memory=blocks * block_bytes)
    engine = cramped.engine
    assert engine.kv_manager.pool.num_blocks == blocks
    ids = [engine.add_request(prompt, GREEDY) for prompt in batch]
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
        check_window(engine)
    assert sum(s.num_preempted for s in engine.step_stats) > 0
    assert [outputs[i].token_ids for i in ids] == expected
    assert engine.kv_manager.pool.num_used == len(engine.kv_manager.pool.lent) * engine.kv_cache.group_size


@pytest.mark.parametrize("kv_format", KIVI)
def test_the_budget_holds_blocks_and_window_alike(kv_format, tiny_llama_kv64):
    """The window takes no memory of its own: its slots are groups of the pool's blocks (16 / bits of them), viewed
    as float16, so the budget counts quantized blocks alone, in whole groups."""
    budget = 4 * 2**20
    engine = make_llm(tiny_llama_kv64, kv_format, kv_cache_memory=budget).engine
    bits = BITS[kv_format]
    group = 16 // bits
    layout = engine_storage_layout(engine, torch.float32, kv_format)
    assert layout.block_group == group
    # codes of K and V, a key (min, step) per channel per block, a value (min, step) per 32 channels per token
    assert layout.bytes_per_token == NUM_LAYERS * (2 * WIDTH * bits / 8 + WIDTH * 4 / BLOCK_SIZE + WIDTH // 32 * 4)
    block_bytes = math.ceil(BLOCK_SIZE * layout.bytes_per_token)
    num_blocks = engine.kv_manager.pool.num_blocks
    assert num_blocks == budget // block_bytes // group * group
    cache = engine.kv_cache
    assert cache.key_codes.shape == cache.value_codes.shape == (NUM_LAYERS, num_blocks * BLOCK_SIZE, WIDTH * bits // 8)
    assert cache.key_params.shape == (NUM_LAYERS, num_blocks, WIDTH, 2)
    assert cache.value_params.shape == (NUM_LAYERS, num_blocks * BLOCK_SIZE, WIDTH // 32, 2)
    assert cache.window_k.shape == (NUM_LAYERS, num_blocks // group, BLOCK_SIZE, WIDTH)
    # slot 1 of layer 2 is the key codes of blocks group .. 2 * group - 1 of that layer
    slot = cache.window_k[2, 1]
    assert slot.data_ptr() == cache.key_codes[2, group * BLOCK_SIZE].data_ptr() and slot.dtype == torch.float16
    assert cache.window_v[2, 1].data_ptr() == cache.value_codes[2, group * BLOCK_SIZE].data_ptr()
    fp16_blocks = make_llm(tiny_llama_kv64, "fp16", kv_cache_memory=budget).engine.kv_manager.pool.num_blocks
    assert num_blocks > 2 * fp16_blocks

    # one request of max_model_len 128 needs 8 blocks, and its window (3 slots and the step's 1) beside them
    assert layout.blocks_beside_a_sequence == (WINDOW_BLOCKS + STEP_SLOTS) * group
    needed = 8 + layout.blocks_beside_a_sequence
    least = needed * block_bytes
    just_enough = make_llm(tiny_llama_kv64, kv_format, kv_cache_memory=least, max_model_len=128).engine
    assert just_enough.kv_manager.pool.num_blocks == needed
    # nothing is set aside per sequence --max-num-seqs allows: the engine's default of 128 builds on the same budget
    roomy_batch = make_llm(tiny_llama_kv64, kv_format, kv_cache_memory=least, max_model_len=128, max_num_seqs=128)
    assert roomy_batch.engine.kv_manager.pool.num_blocks == needed
    with pytest.raises(KvstrataError, match=rf"fewer than one request of max_model_len 128 holds \(and KIVI's float16 "
                                            rf"window beside it, {needed - 8} blocks\); give at least {least} bytes"):
        make_llm(tiny_llama_kv64, kv_format, kv_cache_memory=least - 1, max_model_len=128)


# --- a saved CacheGen context ---------------------------------------------------------------------------------------


def test_a_saved_context_resumes_on_kivi4(tiny_llama_kv64, emma_text, tmp_path):
    """The decoded context is placed by `write`: the blocks outside the window are quantized at once, bit for bit as
    KIVI quantizes the decoded K/V, and only the question is prefilled."""
    saver = make_llm(tiny_llama_kv64, None)
    context_ids = saver.engine.tokenize(emma_text[5000:9000])[:95]
    question = saver.engine.tokenize(" What did she say?")
    path = tmp_path / "context.kv"
    saver.save_context(context_ids, path, levels=["near-lossless"], chunk_tokens=30)  # chunks 30, 30, 30, 5

    llm = make_llm(tiny_llama_kv64, "kivi4")
    cache = llm.engine.kv_cache
    decoded = SavedContext(llm.engine, path).preloaded()
    k_dec = torch.cat([p.k[0] for p in decoded]).reshape(len(context_ids), -1)
    v_dec = torch.cat([p.v[0] for p in decoded]).reshape(len(context_ids), -1)
    writes = []
    write = llm.engine.kv_manager.write_kv

    def checked_write(block_table, kv, start, end):
        write(block_table, kv, start, end)
        old = quantized_tokens(end) // BLOCK_SIZE
        slots = cache.window_slot[block_table[: -(-end // BLOCK_SIZE)]]
        assert (slots[:old] == -1).all() and (slots[old:] >= 0).all()
        want_k, want_v = kivi_of(k_dec[:end], v_dec[:end], 4, old * BLOCK_SIZE)
        got_k, got_v = cache.read(0, block_table, end)
        assert torch.equal(got_k.reshape(end, -1), want_k) and torch.equal(got_v.reshape(end, -1), want_v)
        writes.append((start, end, old))

    llm.engine.kv_manager.write_kv = checked_write
    out = llm.generate(question, GREEDY, context=path)[0]
    assert writes == [(0, 30, 0), (30, 60, 1), (60, 90, 3), (90, 95, 3)]  # blocks 0-2 quantized as they were placed
    assert sum(s.prefill_tokens for s in llm.engine.step_stats) == len(question)
    assert len(out.token_ids) == GREEDY.max_tokens and out.text


def test_a_slot_is_a_group_the_pool_lends_none_of_whose_blocks_is_held():
    """A slot is lent where no block of its group is held, the highest group first, evicting what its free blocks
    cached; the pool hands out blocks of groups that hold some before it opens an empty one; slots go back to the
    pool where it runs short; with every group holding a block, the window has no slot to give."""
    cache = KiviPagedKVCache(4, 32, num_layers=2, num_blocks=16, block_size=16, num_kv_heads=2, head_dim=32,
                             device=torch.device("cpu"), chunk_size=32)
    pool = GroupedBlockPool(16, cache.group_size)
    cache.attach_block_pool(pool)
    held = [pool.allocate() for _ in range(5)]
    assert held == [0, 1, 2, 3, 4]  # group 0 filled, then group 1 opened
    assert {pool.allocate(), pool.allocate()} < {5, 6, 7}  # group 1's free blocks before an empty group's
    pool.register(14, b"cached")  # a free block of group 3 caching a prefix
    pool.share(14)
    pool.release(14)
    evicted = []
    pool.eviction_listeners.append(lambda block, block_hash: evicted.append((block, block_hash)))
    assert cache.reserve(1, keep_free=0)  # one slot for one sequence (two with what a step adds)
    assert sorted(pool.lent) == [2, 3] and evicted == [(14, b"cached")] and pool.lookup(b"cached") is None
    assert pool.num_free == 16 - 7 - 8
    assert not cache.reserve(2, keep_free=0)  # a third slot: one block is free
    assert cache.reserve(0, keep_free=pool.num_free + 4)  # short of blocks: a spare slot goes back
    assert len(pool.lent) == 1 and pool.num_free == 5
    slot = cache._take_slot()
    assert pool.lent == {slot}
    for _ in range(pool.num_free):
        pool.allocate()  # every group holds a block now
    with pytest.raises(KvstrataError, match="no group of free blocks"):
        cache._take_slot()


def test_the_pool_lends_the_highest_group_that_holds_no_block_after_any_history():
    """Over random allocations, shares, releases, lends and returns, every group lent is the highest one none of whose
    blocks is held (what a scan of all groups finds), and None exactly where every group holds a block."""
    rng = random.Random(0)
    pool = GroupedBlockPool(64, 4)
    held: list[int] = []
    for _ in range(3000):
        action = rng.random()
        if action < 0.35 and pool.num_free:
            held.append(pool.allocate())
        elif action < 0.65 and held:
            pool.release(held.pop(rng.randrange(len(held))))
        elif action < 0.75 and held:
            block = rng.choice(held)
            pool.share(block)
            held.append(block)
        elif action < 0.9:
            empty = [g for g, count in enumerate(pool.held_in_group) if not count]
            assert pool.lend_group() == (max(empty) if empty else None)
        elif pool.lent:
            pool.take_back_group(rng.choice(sorted(pool.lent)))
        assert len(pool.empty_groups) <= len(pool.held_in_group)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("threads", [1, 8], ids=["whole-token-items", "one-head-items"])
def test_the_compiled_reader_reads_rows_of_any_width(bits, threads):
    """KV heads of 12 (rows of 12 or 24 values, not whole vectors of 16 codes) read by the compiled reader equal the
    torch decode, over random codes and parameters, with one block still in the float16 window."""
    cache = KiviPagedKVCache(bits, 32, num_layers=1, num_blocks=8, block_size=BLOCK_SIZE, num_kv_heads=2, head_dim=12,
                             device=torch.device("cpu"), chunk_size=32)
    if cache.decode_kernel is None:
        pytest.skip("no C++ compiler: the kernels could not be built")
    gen = torch.Generator().manual_seed(3)
    for codes in (cache.key_codes, cache.value_codes):
        codes.copy_(torch.randint(0, 256, codes.shape, generator=gen, dtype=torch.uint8))
    for params in (cache.key_params, cache.value_params):
        params[..., 0] = torch.randn(params.shape[:-1], generator=gen).half()
        params[..., 1] = (torch.rand(params.shape[:-1], generator=gen) / 4).half()
    cache.window_k.copy_(torch.randn(cache.window_k.shape, generator=gen).half())
    cache.window_v.copy_(torch.randn(cache.window_v.shape, generator=gen).half())
    cache.window_slot[4] = 0
    tables = torch.tensor([[0, 1, 4], [2, 3, 5], [5, 0, 0], [3, 4, 0]])
    lens = torch.tensor([40, 37, 9, 20])
    keys = whole_block_keys(tables, lens, BLOCK_SIZE)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q = torch.randn(4, 6, 12, generator=gen)
        got = cache.attend_in_place(0, q, keys, lens)
    finally:
        torch.set_num_threads(before)
    k, v = cache.gather(0, keys.slots, keys.positions, torch.float32)
    want = attend(q[:, None], k, v, (keys.positions != -1)[:, None])[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
