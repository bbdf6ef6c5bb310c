"""Every KV format's compiled in-place reader (kv/kernels) against the torch path on the same cache: the storage's
decode attention read where the blocks lie equals the reference attention over the K/V the storage gathers and
decodes slot by slot, and whole-block keys read out by the reader (a prefill chunk's) equal the K/V gathered slot by
slot, for sequences of mixed lengths over real cache contents (prefilled by the tiny model)."""

import pytest
import torch

from kvstrata import SamplingParams
from kvstrata.kv.attention_batch import whole_block_keys
from kvstrata.kv.kernels import paged_decode
from kvstrata.kv.reference_attention import attend
from tests.format_cases import CASES, build
from tests.helpers import prefill_in_chunks

KERNEL = paged_decode.kernel()
FLOAT_POOLS = ("fp32", "fp16", "bf16")  # copied whole by block, not read by a reader
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ compiler: the kernels could not be built")


@pytest.fixture(params=[1, 8], ids=["whole-token-items", "one-head-items"])
def reader_threads(request):
    """Torch's thread count while the reader runs: with 1 thread the test's 4 sequences are enough for readers of
    whole-token records to take all of a token's KV heads in one work item; with 8, each KV head is an item."""
    before = torch.get_num_threads()
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("case", CASES)
# two sequences on 8 threads: each item's tokens are split into 3 parts attended apart and merged (200 tokens: 67,
# 67 and 66; the 1-token sequence's parts after its first are empty)
@pytest.mark.parametrize("lens", [[1, 20, 75, 150], [1, 200]], ids=["mixed", "split"])
def test_in_place_reader_equals_the_torch_path(case, lens, reader_threads, tiny_llama_kv64, oaken_calibrations):
    engine, keys = prefilled(tiny_llama_kv64, oaken_calibrations, case, lens)
    torch.set_num_threads(reader_threads)
    storage, config = engine.kv_cache, engine.loaded.config
    gen = torch.Generator().manual_seed(5)
    for layer in (0, config.num_layers - 1):
        q = torch.randn(len(lens), config.num_heads, config.head_dim, generator=gen) * 2
        got = storage.attend_in_place(layer, q, keys, keys.context_lens)
        k, v = storage.gather(layer, keys.slots, keys.positions, torch.float32)
        want = attend(q[:, None], k, v, (keys.positions != -1)[:, None])[:, 0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def prefilled(tiny_llama_kv64, oaken_calibrations, case: str, lens: list[int]):
    """An engine of `case` whose cache holds sequences of `lens` tokens, prefilled in chunks; their whole-block keys."""
    engine = build(tiny_llama_kv64, oaken_calibrations, case).engine
    assert engine.kv_cache.decode_kernel is KERNEL
    gen = torch.Generator().manual_seed(4)
    seqs = [prefill_in_chunks(engine, torch.randint(3, 320, (n,), generator=gen).tolist(), 32, seq_id=i)[1]
            for i, n in enumerate(lens)]
    width = max(len(s.block_table) for s in seqs)
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs])
    return engine, whole_block_keys(tables, torch.tensor(lens), engine.kv_cache.block_size)


@pytest.mark.parametrize("case", [case for case, (kv_format, _) in CASES.items() if not kv_format.startswith("kivi")])
def test_a_prefix_eight_sequences_share_is_read_once_and_equals_the_torch_path(case, reader_threads, tiny_llama_kv64,
                                                                              oaken_calibrations):
    """Eight sequences whose first 3 blocks (48 tokens) are the first sequence's, as the prefix cache shares them,
    each with tokens of its own after them: the reader reads the prefix once for all of them (the kernel counts it)
    and its attention equals the torch path's over the same cache. KIVI's readers never do: a sequence's newest
    tokens lie in its own window, not in its blocks."""
    own = [0, 1, 9, 16, 17, 30, 2, 40]
    engine, keys = prefilled(tiny_llama_kv64, oaken_calibrations, case, [48 + n for n in own])
    tables = keys.block_tables.clone()
    tables[1:, :3] = tables[0, :3]
    keys = whole_block_keys(tables, keys.context_lens, engine.kv_cache.block_size)
    torch.set_num_threads(reader_threads)
    storage, config = engine.kv_cache, engine.loaded.config
    storage.cascade_min_tokens = 48
    q = torch.randn(len(own), config.num_heads, config.head_dim, generator=torch.Generator().manual_seed(5)) * 2
    for layer in (0, config.num_layers - 1):
        reads = KERNEL.shared_prefix_reads()
        got = storage.attend_in_place(layer, q, keys, keys.context_lens)
        assert KERNEL.shared_prefix_reads() == reads + 1
        k, v = storage.gather(layer, keys.slots, keys.positions, torch.float32)
        want = attend(q[:, None], k, v, (keys.positions != -1)[:, None])[:, 0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", [case for case, (kv_format, _) in CASES.items() if kv_format not in FLOAT_POOLS])
def test_whole_block_read_equals_the_torch_gather(case, reader_threads, tiny_llama_kv64, oaken_calibrations,
                                                  monkeypatch):
    """The reader's rows of whole-block keys (`gather_keys`, what a prefill chunk attends over) are the K/V the torch
    path gathers and decodes slot by slot; the rows past each sequence's context are zeros."""
    engine, keys = prefilled(tiny_llama_kv64, oaken_calibrations, case, [1, 20, 75, 150])
    torch.set_num_threads(reader_threads)
    storage = engine.kv_cache
    valid = (keys.positions != -1)[..., None, None]
    for layer in (0, engine.loaded.config.num_layers - 1):
        with monkeypatch.context() as patch:  # the reader's rows, not the torch path's
            patch.setattr(storage, "gather", None)
            got = storage.gather_keys(layer, keys, torch.float32)
        want = storage.gather(layer, keys.slots, keys.positions, torch.float32)
        for read, gathered in zip(got, want):
            assert read.shape == gathered.shape
            torch.testing.assert_close(read * valid, gathered * valid, rtol=1e-5, atol=1e-5)
            assert not read[~valid.expand_as(read)].any()


@pytest.mark.parametrize("case", ["fp32", "fp16", "int8", "int4", "kivi2", "oaken"])
def test_engine_generates_the_same_with_and_without_the_reader(case, tiny_llama_kv64, oaken_calibrations):
    """Greedy output of prompts of different lengths, decoded over many steps (KIVI's blocks leave its window on
    the way), is the same on the compiled reader and on the torch path."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 30, 70)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with_reader = build(tiny_llama_kv64, oaken_calibrations, case)
    assert with_reader.engine.kv_cache.decode_kernel is KERNEL
    without = build(tiny_llama_kv64, oaken_calibrations, case, paged_kernel=False)
    assert without.engine.kv_cache.decode_kernel is None
    assert [o.token_ids for o in with_reader.generate(prompts, params)] == \
        [o.token_ids for o in without.generate(prompts, params)]


def test_a_bad_read_is_refused_naming_the_read(tiny_llama_kv64, oaken_calibrations):
    engine, keys = prefilled(tiny_llama_kv64, oaken_calibrations, "oaken", [20])
    storage = engine.kv_cache
    arguments = storage.format._reader_arguments(0, storage._layer_records[0], storage.sparse, keys.context_lens)
    arguments[4] = arguments[4][:6]  # the layout, one number short
    with pytest.raises(RuntimeError, match="paged_read_oaken: layout is 7 numbers"):
        KERNEL.paged_read_oaken(*arguments, keys.block_tables, keys.context_lens, storage.block_size,
                                *storage.format.head_shape)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="the CPU has no AVX-512")
@pytest.mark.parametrize("case", [case for case in CASES if case.startswith("oaken")])
def test_oaken_reads_alike_on_avx512_and_avx2(case, reader_threads, tiny_llama_kv64, oaken_calibrations):
    """Oaken's dense values are looked up in a table of the row's 16 codes on AVX-512 and converted 8 at a time on
    AVX2, by the same arithmetic: both give the same attention and the same whole-block rows, to the bit."""
    engine, keys = prefilled(tiny_llama_kv64, oaken_calibrations, case, [1, 20, 75, 150])
    torch.set_num_threads(reader_threads)
    storage, config = engine.kv_cache, engine.loaded.config
    q = torch.randn(4, config.num_heads, config.head_dim, generator=torch.Generator().manual_seed(5)) * 2
    for layer in (0, config.num_layers - 1):
        reads = []
        for avx512 in (True, False):
            with paged_decode.kernel_paths(avx512=avx512):
                reads.append([storage.attend_in_place(layer, q, keys, keys.context_lens),
                              *storage.gather_keys(layer, keys, torch.float32)])
        for wide, narrow in zip(*reads):
            assert torch.equal(wide, narrow)
