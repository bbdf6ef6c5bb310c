"""Every KV format's compiled in-place reader (kv/kernels) against the torch path on the same cache: the storage's
decode attention read where the blocks lie equals the reference attention over the K/V the storage gathers and
decodes, for sequences of mixed lengths over real cache contents (prefilled by the tiny model)."""

import pytest
import torch

from kvstrata import SamplingParams
from kvstrata.kv.attention_batch import whole_block_keys
from kvstrata.kv.kernels import paged_decode
from kvstrata.kv.reference_attention import attend
from tests.format_cases import CASES, build
from tests.helpers import prefill_in_chunks

KERNEL = paged_decode.kernel()
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
    engine = build(tiny_llama_kv64, oaken_calibrations, case).engine
    torch.set_num_threads(reader_threads)
    storage = engine.kv_cache
    assert storage.decode_kernel is KERNEL
    gen = torch.Generator().manual_seed(4)
    seqs = [prefill_in_chunks(engine, torch.randint(3, 320, (n,), generator=gen).tolist(), 32, seq_id=i)[1]
            for i, n in enumerate(lens)]
    width = max(len(s.block_table) for s in seqs)
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs])
    context_lens = torch.tensor(lens)
    keys = whole_block_keys(tables, context_lens, storage.block_size)
    config = engine.loaded.config
    for layer in (0, config.num_layers - 1):
        q = torch.randn(len(lens), config.num_heads, config.head_dim, generator=gen) * 2
        got = storage.attend_in_place(layer, q, keys, context_lens)
        k, v = storage.gather_keys(layer, keys, torch.float32)
        want = attend(q[:, None], k, v, (keys.positions != -1)[:, None])[:, 0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


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
