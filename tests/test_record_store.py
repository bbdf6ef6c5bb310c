"""The record formats' compiled store (kv/kernels/record_store.cpp: int8, fp8, fp8_e5m2, int4, and K and V in two of
them) writes the bytes of their torch encoders (kv/formats/scaled_bytes.py, integer.py) at the tokens' slots, on
extreme tokens and in the engine's cache after generating."""

import pytest
import torch

from kvstrata import SamplingParams
from kvstrata.kv.formats.float8 import Float8Format
from kvstrata.kv.formats.integer import Int4Format, Int8Format
from kvstrata.kv.formats.split import SplitFormat
from kvstrata.kv.kernels import paged_decode
from tests.format_cases import NONFINITE_TOKENS, build, extreme_tokens

KERNEL = paged_decode.kernel()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ compiler: the kernels could not be built")


def compiled_store(fmt, x: torch.Tensor, slots: torch.Tensor, total_slots: int) -> dict[str, torch.Tensor]:
    """Records {kind: [total_slots, record_bytes]} after the compiled store of x as both K and V."""
    records = {kind: torch.full((total_slots, fmt.record_bytes_of(kind)), 7, dtype=torch.uint8) for kind in "kv"}
    assert fmt.store_in_place(KERNEL, 0, slots, None, x, x.clone(), records, {})
    return records


@pytest.mark.parametrize("fmt", [Int8Format(64), Int8Format(33), Float8Format(64), Float8Format(33),
                                 Float8Format(64, "fp8_e5m2"), Int4Format(64, 64), Int4Format(96, 64),
                                 Int4Format(192, 32), Int4Format(33, 16),
                                 SplitFormat(Int8Format(96), Int4Format(96, 32)),
                                 SplitFormat(Int4Format(33, 16), Float8Format(33))],
                         ids=["int8", "int8-odd", "fp8", "fp8-odd", "fp8_e5m2", "int4-one-group",
                              "int4-short-last-group", "int4-g32", "int4-odd-g16", "int8/int4", "int4/fp8-odd"])
def test_the_compiled_store_writes_the_torch_encoders_bytes(fmt):
    """Random, zero, largest, tiny and non-finite tokens at shuffled slots. An odd width's last byte holds the last
    value's code in both nibbles, as the torch encoder pads it. A token float16 cannot scale decodes to NaN on both
    paths (its codes are not compared: NaN has none): the NaN token, and the token beyond float16's range where the
    format's parameters cannot hold it (int8's absmax / 127, int4's step; a float8 scale, absmax / 448 or / 57,344,
    can). Slots not written keep what they held."""
    gen = torch.Generator().manual_seed(2)
    x = extreme_tokens(fmt.width, gen)
    slots = torch.randperm(40, generator=gen)[: len(x)]
    stored = compiled_store(fmt, x, slots, 40)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    for kind, records in stored.items():
        reference = fmt.encode(x, 0, kind, torch.arange(len(x))).dense
        unscalable = fmt.decode(reference, None, 0, kind, torch.arange(len(x))).isnan().any(dim=1)
        _, nan_token = NONFINITE_TOKENS
        assert unscalable.nonzero().flatten().tolist() == \
            ([nan_token] if isinstance(fmt.side(kind), Float8Format) else list(NONFINITE_TOKENS))
        assert torch.equal(records[slots][~unscalable], reference[~unscalable])
        decoded = fmt.decode(records[slots], None, 0, kind, torch.arange(len(x)))
        assert torch.equal(decoded.isnan().any(dim=1), unscalable)
        assert (records[untouched] == 7).all()


@pytest.mark.parametrize("case", ["int8", "int4", "int4-group16", "fp8", "int8/int4"])
def test_the_engines_cache_holds_the_torch_paths_bytes(case, tiny_llama_kv64, oaken_calibrations):
    compiled, torch_path = (build(tiny_llama_kv64, oaken_calibrations, case) for _ in range(2))
    torch_path.engine.kv_cache.store_kernel = None
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (7, 45, 90)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in compiled.generate(prompts, params)] == \
        [o.token_ids for o in torch_path.generate(prompts, params)]
    for kind in "kv":
        assert torch.equal(compiled.engine.kv_cache.records[kind], torch_path.engine.kv_cache.records[kind])


def test_bad_store_arguments_are_refused_by_name():
    x, slots = torch.zeros(2, 64), torch.tensor([0, 1])
    records = torch.zeros(4, 66, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="record_store: record form 'int3'; int8, fp8, fp8_e5m2 or int4"):
        KERNEL.record_store(x, x, slots, records, records, "int8", 0, "int3", 0)
    with pytest.raises(RuntimeError, match="record_store: int4 records need a positive group size, got 0"):
        KERNEL.record_store(x, x, slots, records, records, "int4", 0, "int8", 0)
    with pytest.raises(RuntimeError, match="slot 4 is outside the 4 slots"):
        KERNEL.record_store(x, x, torch.tensor([0, 4]), records, records, "fp8", 0, "fp8", 0)
    with pytest.raises(RuntimeError, match=r"record_store: V records must be contiguous uint8 \[slots, 36\]"):
        KERNEL.record_store(x, x, slots, records, records, "int8", 0, "int4", 64)
    assert (records == 0).all()  # nothing written
