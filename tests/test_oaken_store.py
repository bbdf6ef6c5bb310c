"""Oaken's compiled store (kv/kernels/oaken_store.cpp: keys centered or rotated back, both sides encoded, records and
sparse pages written in one call per layer) leaves the cache byte for byte as the torch path does (the format's
`encode`, then the storage's record and sparse-page writes), in every Oaken variant, sparse pools growing included."""

import pytest
import torch

from kvstrata import SamplingParams
from kvstrata.errors import KvstrataError
from kvstrata.kv.sparse_pages import SparsePages
from tests.format_cases import CASES, build

OAKEN_CASES = [case for case, (kv_format, _) in CASES.items() if kv_format == "oaken"]


def tiny_sparse_pools(storage) -> None:
    """Replace the storage's sparse pools by ones of a single page, so that writing grows them."""
    for kind, pages in storage.sparse.items():
        layers, blocks, max_pages = pages.block_pages.shape
        storage.sparse[kind] = SparsePages(layers, blocks, pages.block_size, pages.page_bytes, 1,
                                           max_pages * pages.page_bytes // pages.block_size, torch.device("cpu"))


@pytest.mark.parametrize("case", OAKEN_CASES)
def test_compiled_store_writes_the_bytes_of_the_torch_path(case, tiny_llama_kv64, oaken_calibrations):
    compiled, torch_path = (build(tiny_llama_kv64, oaken_calibrations, case) for _ in range(2))
    if compiled.engine.kv_cache.store_kernel is None:
        pytest.skip("no C++ compiler: the kernels could not be built")
    torch_path.engine.kv_cache.store_kernel = None
    for llm in (compiled, torch_path):
        tiny_sparse_pools(llm.engine.kv_cache)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (7, 45, 90)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in compiled.generate(prompts, params)] == \
        [o.token_ids for o in torch_path.generate(prompts, params)]

    ours, theirs = compiled.engine.kv_cache, torch_path.engine.kv_cache
    for kind in "kv":
        assert torch.equal(ours.records[kind], theirs.records[kind])
        a, b = ours.sparse[kind], theirs.sparse[kind]
        assert a.grown_pages > 0 and a.grown_pages == b.grown_pages
        for name in ("data", "block_pages", "block_fill", "token_offset", "token_count", "free_count"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (kind, name)
        for layer in range(len(a.free_count)):
            assert a.free_pages(layer) == b.free_pages(layer)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_compiled_store_leaves_values_that_are_not_finite_to_the_clear_error(bad, tiny_llama_kv64, oaken_calibrations):
    storage = build(tiny_llama_kv64, oaken_calibrations, OAKEN_CASES[0]).engine.kv_cache
    if storage.store_kernel is None:
        pytest.skip("no C++ compiler: the kernels could not be built")
    heads, dim = storage.kv_shape
    k, v = torch.randn(2, 2, heads, dim)
    v[1, 0, 5] = bad
    records = {kind: r.clone() for kind, r in storage.records.items()}
    with pytest.raises(KvstrataError, match="NaN/inf"):
        storage.store(0, torch.tensor([16, 17]), torch.tensor([0, 1]), k, v)
    assert all(torch.equal(records[kind], storage.records[kind]) for kind in records)
