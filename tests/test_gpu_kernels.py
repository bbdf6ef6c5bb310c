"""The GPU kernels (kv/gpu, Triton) against the torch path: the engine generates the same on them; every format's
records written by its GPU encoder are the torch encoder's bytes, and the tokens its GPU reader gathers are those the
torch path decodes, over real cache contents (prefilled by the tiny model) and padding rows; Oaken's kernels match
the codec on wider tokens. On a GPU they run there; without one, on the CPU in Triton's interpreter
(tests/conftest.py). tests/test_cuda.py also runs the engine on them on a GPU, against the CPU."""

import pytest
import torch

from kvstrata import SamplingParams
from kvstrata.kv.formats.integer import Int4Format, Int8Format
from kvstrata.kv.formats.oaken import codec
from kvstrata.kv.formats.oaken.groups import OakenConfig
from kvstrata.kv.slots import slots_of_positions
from kvstrata.kv.sparse_pages import SparsePages
from kvstrata.model.rotary import apply_rope
from tests.format_cases import CASES, NONFINITE_TOKENS, build, extreme_tokens
from tests.helpers import prefill_in_chunks
from tests.test_oaken_codec import calibrated_bounds, kv

pytest.importorskip("triton")
from kvstrata.kv.gpu import integer_rows, oaken_encode, oaken_rows  # need Triton

pytestmark = pytest.mark.slow

QUANTIZED = [case for case in CASES if not case.startswith(("fp", "bf"))]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_the_torch_path(tiny_llama_kv64, oaken_calibrations, case):
    """An engine whose cache is stored and read by the torch path, on a GPU too."""
    engine = build(tiny_llama_kv64, oaken_calibrations, case, device=DEVICE).engine
    engine.kv_cache.gpu_kernels = False
    return engine


def prefill_random_prompts(engine, lens):
    """Chunked prefills of random prompts of `lens` tokens: their sequences."""
    gen = torch.Generator().manual_seed(4)
    return [prefill_in_chunks(engine, torch.randint(3, 320, (n,), generator=gen).tolist(), 32, seq_id=i)[1]
            for i, n in enumerate(lens)]


@pytest.mark.parametrize("case", ["int8", "int4", "kivi2", "oaken"])
def test_engine_generates_the_same_on_the_gpu_kernels(case, tiny_llama_kv64, oaken_calibrations):
    """Greedy output over prefill chunks and decode steps (the longer prompt's first block leaves KIVI's window of 32
    at 48 tokens, Oaken's pages fill) with every store and read of the cache on the GPU kernels equals the torch
    path's."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 40)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    on_kernels = build(tiny_llama_kv64, oaken_calibrations, case, device=DEVICE)
    storage = on_kernels.engine.kv_cache
    storage.gpu_kernels = True
    storage.decode_kernel = None  # on the CPU, decodes too read through the kernels' gather
    on_torch_path = build(tiny_llama_kv64, oaken_calibrations, case, device=DEVICE, paged_kernel=False)
    assert [o.token_ids for o in on_kernels.generate(prompts, params)] == \
        [o.token_ids for o in on_torch_path.generate(prompts, params)]


@pytest.mark.parametrize("case", QUANTIZED)
def test_gpu_reader_gathers_what_the_torch_path_decodes(case, tiny_llama_kv64, oaken_calibrations):
    lens = [1, 20, 75]
    engine = on_the_torch_path(tiny_llama_kv64, oaken_calibrations, case)
    seqs = prefill_random_prompts(engine, lens)
    storage = engine.kv_cache
    width = max(len(s.block_table) for s in seqs)
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], device=DEVICE)
    positions = torch.arange(max(lens), device=DEVICE).expand(len(lens), -1)
    positions = torch.where(positions < torch.tensor(lens, device=DEVICE)[:, None], positions, -1)  # padding: -1
    slots = slots_of_positions(tables, positions.clamp(min=0), storage.block_size)
    for layer in (0, engine.loaded.config.num_layers - 1):
        for dtype in (torch.float32, torch.float16):
            want = storage.gather(layer, slots, positions, dtype)
            storage.gpu_kernels = True
            got = storage.gather(layer, slots, positions, dtype)
            storage.gpu_kernels = False
            real = positions >= 0  # KIVI's padding rows hold anything finite
            for g, w in zip(got, want):
                assert g.dtype == dtype and g.shape == w.shape
                torch.testing.assert_close(g[real], w[real], rtol=0, atol=0)
                if not case.startswith("kivi"):
                    assert not g[~real].any()


# the formats with a GPU encoder: int8, int4 (and the two as K and V), and Oaken with scales per token and keys
# quantized after RoPE
@pytest.mark.parametrize("case", ["int8", "int4", "int4-group16", "int8/int4", "oaken", "oaken-uncentered",
                                  "oaken-fp16-outliers", "oaken-unshifted", "oaken-4-groups"])
def test_gpu_encoders_write_the_torch_encoders_bytes(case, tiny_llama_kv64, oaken_calibrations):
    """Layer 0's K/V of chunked prefills, as the torch path stored them, stored again on the GPU encoder: the same
    records, and each token's sparse bytes (the pages they lie in may differ). Only layer 0 goes through the encoder:
    in Triton's interpreter every layer would take as long as it."""
    lens = [3, 50, 21]
    on_torch_path = on_the_torch_path(tiny_llama_kv64, oaken_calibrations, case)
    want = on_torch_path.kv_cache
    store, layer0_stores = want.store, []

    def store_and_record(layer, slots, positions, k, v):
        if layer == 0:
            layer0_stores.append((slots.clone(), positions.clone(), k.clone(), v.clone()))
        store(layer, slots, positions, k, v)

    want.store = store_and_record
    prefill_random_prompts(on_torch_path, lens)
    assert len(layer0_stores) == 4  # one store per chunk
    got = build(tiny_llama_kv64, oaken_calibrations, case, device=DEVICE).engine.kv_cache
    got.gpu_kernels = True
    for slots, positions, k, v in layer0_stores:
        got.store(0, slots, positions, k, v)
    slots = torch.cat([slots for slots, *_ in layer0_stores])
    for kind in "kv":
        assert torch.equal(got.records[kind][0], want.records[kind][0])
        if kind in got.sparse:
            assert torch.equal(got.sparse[kind].token_count[0], want.sparse[kind].token_count[0])
            assert torch.equal(got.sparse[kind].read(0, slots), want.sparse[kind].read(0, slots))


@pytest.mark.parametrize("width, group", [(64, 64), (96, 64), (192, 32)], ids=["one-group", "short-last-group", "g32"])
def test_integer_kernels_round_trip_like_the_torch_formats(width, group):
    """Records of another width than the tiny model's, with a padded last group, extreme and zero tokens; a value
    beyond float16's range, or NaN, leaves its token NaN (its codes may differ: NaN has no code)."""
    gen = torch.Generator().manual_seed(1)
    x = extreme_tokens(width, gen).to(DEVICE)
    for fmt, encode, decode in (
            (Int4Format(width, group), lambda x, s, r: integer_rows.int4_encode(x, s, r, group, -(-width // 2)),
             lambda r, s, p, d: integer_rows.int4_decode(r, s, p, width, group, -(-width // 2), d)),
            (Int8Format(width), integer_rows.int8_encode,
             lambda r, s, p, d: integer_rows.int8_decode(r, s, p, width, d))):
        slots = torch.randperm(40, generator=gen)[: len(x)].to(DEVICE)
        positions = torch.arange(len(x), device=DEVICE)
        positions[7] = -1
        records = torch.zeros(40, fmt.record_bytes, dtype=torch.uint8, device=DEVICE)
        encode(x, slots, records)
        reference = fmt.encode(x, 0, "k", positions).dense
        finite = ~torch.isin(torch.arange(len(x), device=DEVICE), torch.tensor(NONFINITE_TOKENS, device=DEVICE))
        assert torch.equal(records[slots][finite], reference[finite])
        decoded = fmt.decode(reference, None, 0, "k", positions)
        decoded[7] = 0
        got = decode(records, slots, positions, torch.float32)
        torch.testing.assert_close(got[finite], decoded[finite], rtol=0, atol=0)
        for token in NONFINITE_TOKENS:
            assert got[token].isnan().any() and decoded[token].isnan().any()


OAKEN_CONFIGS = [OakenConfig(ratios=r, group_shift=shift, outliers=outliers)
                 for r in ((0.04, 0.90, 0.06), (0.02, 0.03, 0.90, 0.05), (0.5, 0.5))
                 for shift in (True, False) for outliers in ("5bit", "fp16")]


@pytest.mark.parametrize("config", OAKEN_CONFIGS,
                         ids=lambda c: f"{len(c.ratios)}groups-{'shift' if c.group_shift else 'noshift'}-{c.outliers}")
@pytest.mark.parametrize("width, centered", [(192, True), (128, False)])
def test_oaken_kernels_match_the_codec(config, width, centered):
    """Wider tokens than the tiny model's (several 64-value blocks; 192 pads to 256), 2 to 4 groups, keys centered by a
    mean key rotated to positions in the thousands. The encoder writes codec.encode_tokens' records and entries; the
    entries appended to sparse pages and read back decode as codec.decode_tokens decodes; a NaN token decodes to NaN."""
    head_dim, device = 64, torch.device(DEVICE)
    x = kv(12, width, seed=3)
    x[5, 7] = float("nan")
    bounds = calibrated_bounds(config, width, seed=3)
    positions = torch.arange(3000, 3000 + len(x)) if centered else torch.arange(len(x))
    mean = torch.randn(width, generator=torch.Generator().manual_seed(4)) if centered else torch.zeros(0)
    # RoPE's tables as RotaryEmbedding.cos_sin makes them: [positions, head_dim]
    angles = torch.arange(3100).float()[:, None] / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    cos, sin = torch.cat((angles, angles), dim=-1).cos(), torch.cat((angles, angles), dim=-1).sin()
    quantized = x
    if centered:  # what the torch path quantizes: the key minus the mean key rotated to its position
        mean_at = apply_rope(mean.view(1, -1, head_dim), cos[positions, None], sin[positions, None])
        mean_at = mean_at.reshape(len(x), width)
        quantized = x - mean_at
    finite = torch.arange(len(x)) != 5
    want = codec.encode_tokens(quantized[finite], bounds, config)
    layout = {"width": width, "groups": config.num_groups, "dense_group": config.dense_group,
              "entry_bytes": codec.sparse_entry_bytes(config), "float16_outliers": config.outliers == "fp16",
              "add_mean": 2 if centered else 0, "head_dim": head_dim, "block_size": 8, "page_bytes": 64}
    slots = torch.randperm(16, generator=torch.Generator().manual_seed(5))[: len(x)].sort().values.to(device)
    records = torch.zeros(16, codec.dense_bytes(width, config), dtype=torch.uint8, device=device)
    entries, entry_bytes = oaken_encode.oaken_encode(
        x.to(device), positions.to(device), slots, records, codec.encoder_tables(bounds, config, device), layout,
        mean.to(device), cos.to(device), sin.to(device))
    assert torch.equal(records[slots][finite].cpu(), want.dense)
    assert torch.equal(entry_bytes[finite].cpu(), want.sparse_bytes)
    sent = torch.cat([row[:n] for row, n in zip(entries[finite].cpu(), entry_bytes[finite].tolist())])
    assert torch.equal(sent, want.sparse)

    pages = SparsePages(1, 2, 8, 64, initial_pages=2, max_bytes_per_token=entries.shape[1], device=device)
    pages.append_on_gpu(0, slots, entries, entry_bytes)
    tables, shift = codec.reader_tables(bounds, config, device)
    got = oaken_rows.oaken_decode(records, pages.layer_tensors(0), tables, shift, layout, mean.to(device),
                                  cos.to(device), sin.to(device), slots, positions.to(device), torch.float32).cpu()
    decoded = codec.decode_tokens(want.dense, want.sparse, bounds, config, width)
    if centered:
        decoded = decoded + mean_at[finite]
    torch.testing.assert_close(got[finite], decoded, rtol=0, atol=0)
    assert got[5].isnan().any()
