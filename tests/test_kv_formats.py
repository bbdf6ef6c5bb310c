"""Quantized KV formats: int8/int4 records, sparse pages, every --kv-format in the engine (prefix sharing,
preemption, blocks per budget), bit-exactness of the stored layer-0 K/V, and the CLI."""

import itertools
import json
import math
import random

import pytest
import torch

from kvstrata import LLM, SamplingParams
from kvstrata.cli.main import main
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.kv.formats.float8 import Float8Format
from kvstrata.kv.formats.float16_params import params_from_bytes
from kvstrata.kv.formats.integer import INT4_GROUP, Int4Format, Int8Format
from kvstrata.kv.formats.oaken.codec import encode_tokens
from kvstrata.kv.formats.oaken.thresholds import DEFAULT_RATIOS, ForeignCalibrationError
from kvstrata.kv.paged_cache import PagedKVCache
from kvstrata.kv.quantized_cache import QuantizedPagedKVCache
from kvstrata.kv.sparse_pages import SparsePages
from kvstrata.model.rotary import apply_rope
from tests.helpers import prefill_in_chunks

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
QUANTIZED = ("int8", "int4", "fp8", "oaken", "int8/int4")
BLOCK_SIZE = 16


# --- int8 / int4 -------------------------------------------------------------------------------------------------


def sample_rows(width: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different scales, with exact zeros sprinkled in, a zero row, constant rows and a row whose values
    all lie far from zero."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-3, 3, 24)[:, None]
    x = torch.randn(24, width, generator=gen) * scales
    x[torch.rand(x.shape, generator=gen) < 0.1] = 0.0
    constants = torch.tensor([[0.3], [-2.5], [1000.0], [1e-3]]).expand(4, width)
    offset = 5.0 + 0.1 * torch.randn(1, width, generator=gen)
    return torch.cat((x, torch.zeros(1, width), constants, offset))


def positions_of(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[0])


def round_trip(fmt, x: torch.Tensor):
    encoded = fmt.encode(x, 0, "k", positions_of(x))
    assert encoded.dense.dtype == torch.uint8 and encoded.dense.shape == (x.shape[0], fmt.record_bytes)
    assert encoded.sparse is None and not fmt.has_sparse
    return encoded.dense, fmt.decode(encoded.dense, None, 0, "k", positions_of(x))


@pytest.mark.parametrize("width", [32, 64, 96, 128, 4096])
def test_record_bytes(width):
    assert Int8Format(width).record_bytes == width + 2
    assert Float8Format(width).record_bytes == Float8Format(width, "fp8_e5m2").record_bytes == width + 2
    assert Int4Format(width).record_bytes == width // 2 + 4 * math.ceil(width / INT4_GROUP)
    assert Int4Format(width, 16).record_bytes == width // 2 + 4 * math.ceil(width / 16)


@pytest.mark.parametrize("width", [32, 64, 96, 128])
def test_int8_decodes_within_half_a_step(width):
    fmt = Int8Format(width)
    x = sample_rows(width)
    dense, y = round_trip(fmt, x)
    assert y.shape == x.shape and y.dtype == torch.float32
    absmax = x.abs().amax(dim=1, keepdim=True)
    step = params_from_bytes(dense[:, width:])
    assert (step >= absmax / 127).all() and (step <= absmax / 127 * (1 + 2**-10) + 2**-24).all()
    assert ((y - x).abs() <= step / 2 + 1e-6 * absmax).all()
    assert (y[x == 0] == 0).all()  # every exact zero, in every row
    constant = x[-5:-1]
    assert ((y[-5:-1] - constant).abs() <= constant.abs() / 254).all()


@pytest.mark.parametrize(("name", "mantissa_bits", "code_max"), [("fp8", 3, 448), ("fp8_e5m2", 2, 57344)])
@pytest.mark.parametrize("width", [32, 64, 96])
def test_float8_decodes_within_half_a_float8_step_of_each_value(name, mantissa_bits, code_max, width):
    """Each value comes back within half a step of the float8 number nearest value / scale (relative 2^-(m+1), or
    half the smallest subnormal step near zero) times the token's scale, absmax / code_max rounded up to a float16."""
    fmt = Float8Format(width, name)
    x = sample_rows(width, seed=4)
    dense, y = round_trip(fmt, x)
    assert y.shape == x.shape and y.dtype == torch.float32
    absmax = x.abs().amax(dim=1, keepdim=True)
    scale = params_from_bytes(dense[:, width:])
    assert (scale >= absmax / code_max).all() and (scale <= absmax / code_max * (1 + 2**-10) + 2**-24).all()
    subnormal_step = torch.finfo(fmt.dtype).smallest_normal * 2.0**-mantissa_bits
    bound = torch.maximum(x.abs() * 2.0 ** -(mantissa_bits + 1), scale * subnormal_step / 2)
    assert ((y - x).abs() <= bound * (1 + 1e-6) + 1e-30).all()
    assert (y[x == 0] == 0).all()


@pytest.mark.parametrize(("width", "group"), [(32, 64), (64, 64), (96, 64), (128, 64), (96, 32), (128, 16), (72, 16)])
def test_int4_decodes_within_half_a_step_of_each_groups_own_range(width, group):
    fmt = Int4Format(width, group)
    x = sample_rows(width, seed=1)
    dense, y = round_trip(fmt, x)
    assert y.shape == x.shape and y.dtype == torch.float32
    params = params_from_bytes(dense[:, -4 * fmt.groups:]).view(-1, fmt.groups, 2)
    for g in range(fmt.groups):
        values, got = x[:, g * group : (g + 1) * group], y[:, g * group : (g + 1) * group]
        low, step = params[:, g, :1], params[:, g, 1:]
        spread = values.amax(dim=1, keepdim=True) - values.amin(dim=1, keepdim=True)
        absmax = values.abs().amax(dim=1, keepdim=True)
        assert (low <= values.amin(dim=1, keepdim=True)).all()
        # the step comes from this group's values only (padding of a short last group does not widen it)
        assert (step <= (spread + 2**-9 * absmax) / 15 * (1 + 2**-9) + 2**-24).all()
        assert ((got - values).abs() <= step / 2 + 1e-6 * absmax + 1e-7).all()
    assert (y[24] == 0).all()  # the zero row
    assert torch.equal(y[26:28], x[26:28])  # constants float16 can hold (-2.5, 1000) come back exactly
    assert ((y[25] - x[25]).abs() <= 0.3 * 2**-10).all()


def test_int4_zero_groups_stay_zero():
    fmt = Int4Format(192)
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(2))
    x[:, 64:128] = 0.0
    _, y = round_trip(fmt, x)
    assert (y[:, 64:128] == 0).all()


@pytest.mark.parametrize("fmt", [Int8Format(96), Int4Format(96), Float8Format(96), Float8Format(96, "fp8_e5m2")],
                         ids=["int8", "int4", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_decode_to_nan_in_their_own_token(fmt, bad):
    """Stored without a host check, and never silently finite: the token's values (int8: its row; int4: the
    group holding the bad value) come back NaN, so attention over it gives NaN logits and the engine
    ends that request alone; the other tokens round-trip as if it were not there."""
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(3))
    clean = round_trip(fmt, x)[1]
    x[2, 7] = bad
    y = round_trip(fmt, x)[1]
    poisoned = slice(0, fmt.group_size) if isinstance(fmt, Int4Format) else slice(0, 96)
    assert y[2, poisoned].isnan().all() and not y[2, poisoned.stop:].isnan().any()
    assert torch.equal(y[[0, 1, 3]], clean[[0, 1, 3]])


def test_values_beyond_float16_parameters_decode_to_nan():
    for fmt, x in ((Int8Format(64), torch.full((1, 64), 1e7)), (Int4Format(64), torch.full((1, 64), -1e6)),
                   (Float8Format(64), torch.full((1, 64), 1e8)), (Float8Format(64, "fp8_e5m2"), torch.full((1, 64), 1e10))):
        assert round_trip(fmt, x)[1].isnan().all()


# --- sparse pages -------------------------------------------------------------------------------------------------


def write_in_pieces(pages: SparsePages, layer: int, counts: list[int], rng: random.Random) -> dict[int, torch.Tensor]:
    """Write random bytes for every slot, each block's tokens in slot order but split over several calls, and each
    call holding pieces of several blocks in random block order (as a batch of sequences does)."""
    block_size = pages.block_size
    num_blocks = len(counts) // block_size
    pieces = {}
    for block in range(num_blocks):
        cuts = sorted(rng.sample(range(1, block_size), 3))
        bounds = [0, *cuts, block_size]
        first = block * block_size
        pieces[block] = [list(range(first + a, first + b)) for a, b in itertools.pairwise(bounds)]
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    written = {}
    while any(pieces.values()):
        blocks = [b for b in pieces if pieces[b]]
        rng.shuffle(blocks)
        slots = [s for b in blocks[: rng.randint(1, len(blocks))] for s in pieces[b].pop(0)]
        chunks = [torch.randint(0, 256, (counts[s],), dtype=torch.uint8, generator=gen) for s in slots]
        written.update(zip(slots, chunks))
        pages.write(layer, torch.tensor(slots), torch.cat(chunks), torch.tensor([counts[s] for s in slots]))
    return written


def check_reads(pages: SparsePages, layer: int, written: dict[int, torch.Tensor], slots: list[int]) -> None:
    got = pages.read(layer, torch.tensor(slots, dtype=torch.long))
    assert torch.equal(got, torch.cat([written[s] for s in slots]))


def check_page_accounting(pages: SparsePages) -> None:
    for layer in range(len(pages.free_count)):
        free = pages.free_pages(layer)
        owned = pages.block_pages[layer][pages.block_pages[layer] >= 0].tolist()
        assert len(set(free)) == len(free) and len(set(owned)) == len(owned) and not set(free) & set(owned)
        assert sorted(free + owned) == list(range(pages.num_pages))
        fills = pages.block_fill[layer]
        assert (pages.block_pages[layer] >= 0).sum(1).tolist() == (-(-fills // pages.page_bytes)).tolist()


def skip_unless_interpreted_gpu_writer():
    """The GPU writer's tests here run it on CPU tensors, in Triton's interpreter; on a GPU, tests/test_gpu_kernels.py
    runs it through Oaken's store."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("Triton runs compiled here, on CUDA tensors only")


def append_on_gpu_as_write(pages: SparsePages, max_bytes: int):
    """`pages.write` by the GPU writer (in Triton's interpreter without a GPU): each token's bytes in a scratch row."""

    def write(layer, slots, data, counts):
        entries = torch.zeros(len(slots), max_bytes, dtype=torch.uint8)
        for row, (start, count) in enumerate(zip((counts.cumsum(0) - counts).tolist(), counts.tolist())):
            entries[row, :count] = data[start : start + count]
        pages.append_on_gpu(layer, slots, entries, counts.int())

    return write


def use_writer(pages: SparsePages, writer: str, max_bytes: int) -> None:
    """Make `pages.write` the compiled writer, the torch one or the GPU one (skipping where it cannot run)."""
    if writer == "torch":
        pages.compiled = None
    elif writer == "gpu":
        skip_unless_interpreted_gpu_writer()
        pages.write = append_on_gpu_as_write(pages, max_bytes)
    elif pages.compiled is None:
        pytest.skip("no C++ compiler: the compiled writer could not be built")


@pytest.mark.parametrize("writer", ["compiled", "torch", "gpu"])
def test_sparse_pages_keep_every_tokens_bytes_and_grow_when_short(writer):
    rng = random.Random(0)
    num_layers, num_blocks, block_size, page_bytes, max_bytes = 2, 6, 8, 16, 20
    pages = SparsePages(num_layers, num_blocks, block_size, page_bytes, initial_pages=3,
                        max_bytes_per_token=max_bytes, device=torch.device("cpu"))
    use_writer(pages, writer, max_bytes)
    slots = num_blocks * block_size
    written = []
    for layer in range(num_layers):
        counts = [rng.choice([0, max_bytes, rng.randint(1, max_bytes - 1)]) for _ in range(slots)]
        counts[block_size : 2 * block_size] = [max_bytes] * block_size  # a block at its worst case
        counts[2 * block_size : 3 * block_size] = [0] * block_size  # a block without outliers
        written.append(write_in_pieces(pages, layer, counts, rng))
    assert pages.grown_pages > 0 and pages.num_pages == 3 + pages.grown_pages
    check_page_accounting(pages)
    # some token straddles a page boundary onto a page that is not the next one in memory
    offsets, counts = pages.token_offset[0].long(), pages.token_count[0].long()
    first, last = offsets // page_bytes, (offsets + counts - 1) // page_bytes
    straddling = ((counts > 0) & (first != last)).nonzero().flatten()
    assert len(straddling)
    blocks = straddling // block_size
    physical = pages.block_pages[0, blocks, first[straddling]], pages.block_pages[0, blocks, last[straddling]]
    assert (physical[1] != physical[0] + 1).any()
    for layer in range(num_layers):
        order = list(range(slots))
        rng.shuffle(order)
        check_reads(pages, layer, written[layer], order)
        check_reads(pages, layer, written[layer], [5, 5, 40, 0, 17, 5])
        check_reads(pages, layer, written[layer], [2 * block_size + 3])  # nothing
        assert pages.read(layer, torch.tensor([], dtype=torch.long)).numel() == 0

    # handing blocks 1 and 4 out again frees their pages (in every layer) and forgets their tokens
    in_use, grown = pages.pages_in_use(), pages.grown_pages
    released = int((pages.block_pages[:, [1, 4]] >= 0).sum())
    pages.release([1, 4])
    assert pages.pages_in_use() == in_use - released
    released_slots = [s for b in (1, 4) for s in range(b * block_size, (b + 1) * block_size)]
    assert (pages.token_count[:, released_slots] == 0).all()
    assert (pages.block_fill[:, [1, 4]] == 0).all() and (pages.block_pages[:, [1, 4]] == -1).all()
    check_page_accounting(pages)
    for layer in range(num_layers):
        assert pages.read(layer, torch.tensor(released_slots)).numel() == 0
        kept = [s for s in range(slots) if s not in released_slots]
        check_reads(pages, layer, written[layer], kept[::-1])
    # new contents of block 4 reuse the freed pages; nothing else changes
    new_counts = [max_bytes] * block_size
    gen = torch.Generator().manual_seed(9)
    new = [torch.randint(0, 256, (max_bytes,), dtype=torch.uint8, generator=gen) for _ in range(block_size)]
    pages.write(0, torch.arange(4 * block_size, 5 * block_size), torch.cat(new), torch.tensor(new_counts))
    assert pages.grown_pages == grown
    written[0].update(zip(range(4 * block_size, 5 * block_size), new))
    check_page_accounting(pages)
    check_reads(pages, 0, written[0], [s for s in range(slots) if not block_size <= s < 2 * block_size][::-1])


@pytest.mark.parametrize("writer", ["compiled", "torch", "gpu"])
def test_discarded_drafts_leave_no_bytes_or_pages_behind_and_their_slots_are_written_anew(writer):
    """A sequence's drafts in the last slots of block 0 and across blocks 1 and 2 are rejected: each block's fill
    goes back to the bytes of its kept tokens, pages past it are freed, and the tokens written there next read back
    their own bytes, in every writer."""
    num_layers, block_size, page_bytes, max_bytes = 2, 8, 16, 20
    pages = SparsePages(num_layers, 3, block_size, page_bytes, initial_pages=4, max_bytes_per_token=max_bytes,
                        device=torch.device("cpu"))
    use_writer(pages, writer, max_bytes)
    gen = torch.Generator().manual_seed(3)
    written = [{} for _ in range(num_layers)]

    def write(slots: list[int], counts: list[int]) -> None:
        for layer in range(num_layers):
            chunks = [torch.randint(0, 256, (c,), dtype=torch.uint8, generator=gen) for c in counts]
            written[layer].update(zip(slots, chunks))
            pages.write(layer, torch.tensor(slots), torch.cat(chunks), torch.tensor(counts))

    def check(kept: list[int]) -> None:
        check_page_accounting(pages)
        for layer in range(num_layers):
            check_reads(pages, layer, written[layer], kept[::-1])
            fills = [sum(len(written[layer][s]) for s in kept if s // block_size == b) for b in range(3)]
            assert pages.block_fill[layer].tolist() == fills

    kept = [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13]
    write(kept, [3, 0, 7, 20, 1, 5, 2, 20, 20, 0, 9, 4])
    drafts = [6, 7, 14, 15, 16, 17]
    write(drafts, [max_bytes] * len(drafts))
    in_use = pages.pages_in_use()
    pages.discard(torch.tensor(drafts))
    assert pages.pages_in_use() < in_use and (pages.token_count[:, drafts] == 0).all()
    check(kept)
    grown, again = pages.grown_pages, [6, 14, 15, 16]
    write(again, [5, 20, 1, 20])  # fewer bytes than the drafts' freed pages held
    check(kept + again)
    assert pages.grown_pages == grown or writer == "gpu"  # the GPU writer grows by a bound, not the exact need


def test_gpu_writer_grows_the_pool_only_past_the_calls_bytes():
    """Eight tokens of 2 bytes fit in the 4 free pages, though their worst case (20 bytes each: 16 pages) does not:
    the writer reads the call's bytes before it grows anything. Then a call that does need more pages grows the
    pool, and grown_bytes counts what was added."""
    skip_unless_interpreted_gpu_writer()
    pages = SparsePages(1, 4, 8, 16, initial_pages=4, max_bytes_per_token=20, device=torch.device("cpu"))
    write = append_on_gpu_as_write(pages, 20)
    small = torch.arange(16, dtype=torch.uint8)
    write(0, torch.arange(8), small, torch.full((8,), 2))
    assert pages.grown_pages == 0
    check_reads(pages, 0, {slot: small[2 * slot : 2 * slot + 2] for slot in range(8)}, list(range(8)))
    large = torch.arange(160, dtype=torch.uint8)
    write(0, torch.arange(8, 16), large, torch.full((8,), 20))
    assert pages.grown_pages > 0 and pages.grown_bytes() == pages.grown_pages * 16
    check_reads(pages, 0, {8 + i: large[20 * i : 20 * i + 20] for i in range(8)}, list(range(8, 16)))
    check_page_accounting(pages)


# --- the engine ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp_engine(tiny_llama_kv64):
    return LLMEngine(EngineConfig(model=str(tiny_llama_kv64), kv_cache_memory="8MiB", threads=1))


@pytest.fixture(scope="module")
def calibration(oaken_calibrations):
    return oaken_calibrations[DEFAULT_RATIOS]


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (37, 64, 90, 21, 48)]


def make_llm(tiny_llama_kv64, kv_format, calibration, **options) -> LLM:
    options = {"kv_cache_memory": "8MiB", "threads": 1, "chunk_size": 32, **options}
    return LLM(str(tiny_llama_kv64), kv_format=kv_format, oaken_calibration=str(calibration), **options)


def bytes_per_token(engine: LLMEngine) -> float:
    """What one token costs, from the cache's own storage: dtype for full precision, format records otherwise."""
    cache, mc = engine.kv_cache, engine.loaded.config
    if isinstance(cache, QuantizedPagedKVCache):
        return QuantizedPagedKVCache.bytes_per_token(cache.format, mc.num_layers)
    return PagedKVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, cache.k.dtype)


@pytest.mark.parametrize("kv_format", ["fp16", *QUANTIZED])
def test_every_format_generates_shares_prefixes_and_survives_preemption(kv_format, tiny_llama_kv64, calibration, prompts):
    llm = make_llm(tiny_llama_kv64, kv_format, calibration)
    assert isinstance(llm.engine.kv_cache, QuantizedPagedKVCache) == (kv_format in QUANTIZED)
    prefix = prompts[2]  # 90 tokens: 5 full blocks
    first = llm.generate([prefix + [10, 11]], GREEDY)[0]
    second = llm.generate([prefix + [12]], GREEDY)[0]
    for out in (first, second):
        assert len(out.token_ids) == GREEDY.max_tokens and out.finish_reason == "length" and out.text
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 80)
    unshared = make_llm(tiny_llama_kv64, kv_format, calibration, enable_prefix_caching=False)
    assert unshared.generate([prefix + [12]], GREEDY)[0].token_ids == second.token_ids

    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    block_bytes = math.ceil(BLOCK_SIZE * bytes_per_token(llm.engine))
    cramped = make_llm(tiny_llama_kv64, kv_format, calibration, kv_cache_memory=10 * block_bytes, max_model_len=128)
    assert cramped.engine.kv_manager.pool.num_blocks == 10
    outputs = cramped.generate(prompts, GREEDY)
    assert sum(s.num_preempted for s in cramped.engine.step_stats) > 0
    assert [o.token_ids for o in outputs] == expected
    assert cramped.engine.kv_manager.pool.num_used == 0


def test_smaller_formats_get_more_blocks_from_the_same_budget(tiny_llama_kv64, calibration):
    budget = 4 * 2**20
    mc = None
    per_token, blocks = {}, {}
    for kv_format in ("fp32", "fp16", "bf16", *QUANTIZED):
        engine = make_llm(tiny_llama_kv64, kv_format, calibration, kv_cache_memory=budget).engine
        mc = engine.loaded.config
        per_token[kv_format] = bytes_per_token(engine)
        blocks[kv_format] = engine.kv_manager.pool.num_blocks
        assert blocks[kv_format] == budget // math.ceil(BLOCK_SIZE * per_token[kv_format])
        if kv_format in QUANTIZED:
            fmt = engine.kv_cache.format
            sparse = fmt.expected_sparse_bytes * 1.25 + SparsePages.TABLE_BYTES if fmt.has_sparse else 0
            assert per_token[kv_format] == mc.num_layers * sum(fmt.record_bytes_of(kind) + sparse for kind in "kv")
            for kind in "kv":
                assert engine.kv_cache.records[kind].shape == (mc.num_layers, blocks[kv_format] * BLOCK_SIZE,
                                                               fmt.record_bytes_of(kind))
    width = mc.num_kv_heads * mc.head_dim
    assert per_token["fp32"] == 2 * mc.num_layers * width * 4
    assert per_token["fp16"] == per_token["bf16"] == per_token["fp32"] / 2
    for a, cost_a in per_token.items():
        for b, cost_b in per_token.items():
            if cost_a < cost_b:
                assert blocks[a] > blocks[b], (a, b, per_token, blocks)
    assert max(per_token[f] for f in QUANTIZED) < per_token["fp16"]
    # int4 with smaller groups: more (min, step) pairs per token
    int4_16 = make_llm(tiny_llama_kv64, "int4", calibration, kv_cache_memory=budget, int4_group_size=16).engine
    assert int4_16.kv_cache.format.group_size == 16
    assert bytes_per_token(int4_16) == per_token["int4"] + 2 * mc.num_layers * 4 * (width // 16 - width // 64)


@pytest.mark.parametrize(("kv_format", "keys", "centering"), [
    ("int8", "pre-rope", True), ("int4", "pre-rope", True), ("oaken", "pre-rope", True), ("oaken", "post-rope", True),
    ("oaken", "post-rope", False)])
def test_layer_0_cache_holds_exactly_the_formats_round_trip(kv_format, keys, centering, tiny_llama_kv64, fp_engine,
                                                            calibration, prompts):
    """Layer 0's K/V do not depend on the cache, so a quantized cache must hold exactly what its format makes of the
    full-precision K/V (here written over several prefill chunks, blocks straddling chunks)."""
    token_ids = prompts[2] + prompts[0]
    n = len(token_ids)
    _, seq = prefill_in_chunks(fp_engine, token_ids, 24)
    k_full, v_full = fp_engine.kv_cache.read(0, seq.block_table, n)
    fp_engine.kv_manager.free(seq)
    engine = make_llm(tiny_llama_kv64, kv_format, calibration, oaken_keys=keys, oaken_key_centering=centering).engine
    _, seq = prefill_in_chunks(engine, token_ids, 24)
    k_got, v_got = engine.kv_cache.read(0, seq.block_table, n)
    fmt = engine.kv_cache.format
    if kv_format == "oaken":
        assert fmt.keys == keys and (fmt.key_mean is not None) == centering
        assert all(pages.pages_in_use() > 0 for pages in engine.kv_cache.sparse.values())
    positions = torch.arange(n)
    for kind, full, got in (("k", k_full, k_got), ("v", v_full, v_got)):
        encoded = fmt.encode(full.reshape(n, -1), 0, kind, positions)
        want = fmt.decode(encoded.dense, encoded.sparse, 0, kind, positions).view_as(full)
        assert torch.equal(got, want), kind
        assert not torch.equal(got, full)  # it was quantized


@pytest.mark.parametrize("keys", ["post-rope", "pre-rope"])
def test_oaken_quantizes_keys_minus_the_mean_key_at_their_position(keys, tiny_llama_kv64, calibration):
    """A key is quantized as key - mean key (rotated to its position after RoPE) and decoded plus it; V is never
    centered. (What centering buys on real keys: docs/BENCHMARKS.md.)"""
    fmt = make_llm(tiny_llama_kv64, "oaken", calibration, oaken_keys=keys).engine.kv_cache.format
    plain = make_llm(tiny_llama_kv64, "oaken", calibration, oaken_keys=keys,
                     oaken_key_centering=False).engine.kv_cache.format
    assert plain.key_mean is None
    n, heads = 40, fmt.head_shape[0]
    positions = torch.arange(100, 100 + n)
    cos, sin = fmt.rotary.cos_sin(positions, torch.float32)
    # keys as on the default model, where the mean is most of a key's energy
    spread = float(fmt.bounds[0, "k"][0].diff()) / 4
    gen = torch.Generator().manual_seed(0)
    fmt.key_mean = 2 * spread * torch.randn(1, fmt.width, generator=gen)
    pre = fmt.key_mean.view(1, heads, -1) + spread * torch.randn(n, *fmt.head_shape, generator=gen)
    x = apply_rope(pre, cos, sin).reshape(n, -1)  # keys as the cache holds them
    mean = fmt.key_mean[0].view(1, heads, -1)
    rotated_mean = apply_rope(mean.expand(n, -1, -1), cos, sin).reshape(n, -1)
    quantized = (pre - mean).reshape(n, -1) if keys == "pre-rope" else x - rotated_mean
    encoded = fmt.encode(x, 0, "k", positions)
    want = encode_tokens(quantized, fmt.bounds[0, "k"], fmt.config)
    assert torch.equal(encoded.dense, want.dense) and torch.equal(encoded.sparse, want.sparse)
    decoded = fmt.decode(encoded.dense, encoded.sparse, 0, "k", positions)
    if keys == "pre-rope":
        torch.testing.assert_close(decoded, apply_rope((want.meant.view(n, heads, -1) + mean), cos, sin).reshape(n, -1))
    else:
        torch.testing.assert_close(decoded, want.meant + rotated_mean)
    assert not torch.equal(encoded.dense, plain.encode(x, 0, "k", positions).dense)
    assert torch.equal(fmt.encode(x, 0, "v", positions).dense, plain.encode(x, 0, "v", positions).dense)


def test_a_calibration_of_another_model_is_refused(tiny_llama_kv64, calibration, tmp_path, capsys):
    raw = json.loads(calibration.read_text())
    raw["fingerprint"] = "0123456789abcdef"
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps(raw))
    with pytest.raises(ForeignCalibrationError, match="calibrated for model 0123456789abcdef"):
        make_llm(tiny_llama_kv64, "oaken", foreign)
    args = ["generate", "Emma", "--model", str(tiny_llama_kv64), "--kv-cache-memory", "8MiB", "--kv-format", "oaken",
            "--oaken-calibration", str(foreign), "--threads", "1"]
    assert main(args) == 2
    assert "error: the oaken thresholds" in capsys.readouterr().err


def test_cli_generates_with_oaken(tiny_llama_kv64, calibration, capsys):
    args = ["generate", "Emma Woodhouse", "--model", str(tiny_llama_kv64), "--max-tokens", "8", "--kv-cache-memory", "8MiB",
            "--kv-format", "oaken", "--oaken-calibration", str(calibration), "--threads", "1"]
    assert main(args) == 0
    assert capsys.readouterr().out.strip()
