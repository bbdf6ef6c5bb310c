"""KV offload on a CUDA GPU: the host pool stays in main memory, `full` copies each layer's KV over before its
attention, and InfiniGen's fetch for layer i is copied on a side stream that layer i's attention waits for.
Skipped where torch sees no CUDA GPU, as on CI; run them on a GPU machine."""

import math

import pytest
import torch

from kvstrata.bench.offload import run_offload_grid
from kvstrata.kv.offload import transfers
from tests.infinigen_cases import EVERYTHING, engine_for, generate, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU")


def prompts() -> list[list[int]]:
    shared = random_prompts(4, 48)[0]
    return [shared + p for p in random_prompts(5, 30, 70, 5)] + random_prompts(6, 90)


def test_selecting_every_token_on_cuda_gives_the_greedy_output_of_no_offload(tiny_llama, skew_files):
    want = generate(engine_for(tiny_llama, device="cuda"), prompts(), 16)
    full = engine_for(tiny_llama, device="cuda", kv_offload="full")
    assert full.kv_cache.device.type == "cpu"
    assert generate(full, prompts(), 16) == want
    infinigen = engine_for(tiny_llama, device="cuda", kv_offload="infinigen",
                           infinigen_calibration=str(skew_files["llama"]), **EVERYTHING)
    assert infinigen.attention.fetch_stream is not None
    assert generate(infinigen, prompts(), 16) == want
    assert infinigen.attention.stats.summary()["decode_fraction_fetched"] > 0.9


def test_attention_waits_for_a_late_fetch(tiny_llama, skew_files, monkeypatch):
    """Each side-stream copy is held back ~10 ms on the GPU: layer i's attention must still read the rows copied for
    it, not what its buffer held before (the output would then differ from `none`'s)."""
    copy = transfers.WorkingBuffers.copy
    late = []

    def late_copy(buffers, name, x, stream=None):
        if stream is not None:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(20_000_000)  # GPU clock cycles
            late.append(name)
        return copy(buffers, name, x, stream)

    monkeypatch.setattr(transfers.WorkingBuffers, "copy", late_copy)
    want = generate(engine_for(tiny_llama, device="cuda"), prompts(), 12)
    engine = engine_for(tiny_llama, device="cuda", kv_offload="infinigen",
                        infinigen_calibration=str(skew_files["llama"]), **EVERYTHING)
    assert generate(engine, prompts(), 12) == want
    assert late  # the fetches did go through the side stream


def test_default_infinigen_and_h2o_run_on_cuda(tiny_llama, skew_files):
    for options in ({"kv_offload": "infinigen", "infinigen_calibration": str(skew_files["llama"]),
                     "infinigen_full_layers": 1, "infinigen_alpha": 1.0},
                    {"kv_offload": "h2o", "h2o_budget": 0.3}):
        engine = engine_for(tiny_llama, device="cuda", **options)
        outputs = generate(engine, random_prompts(7, 200, 120), 12)
        assert [len(o) for o in outputs] == [12, 12]
    stats = engine.attention.stats.summary()
    assert 0 < stats["decode_fraction_fetched"] < 1  # h2o: the share of the KV its decodes attended


def test_the_offload_benchmark_runs_on_cuda(tiny_llama, skew_files):
    engine = engine_for(tiny_llama, device="cuda", infinigen_calibration=str(skew_files["llama"]))
    rows = run_offload_grid(engine.config, engine.loaded, random_prompts(3, 300)[0], [200], [2], steps=3,
                            progress=lambda line: None)
    row, modes = rows[0], ("none", "full", "infinigen")
    assert all(row[mode]["tokens_per_s"] > 0 for mode in modes)
    # a GPU's copies are measured, not modeled
    assert not any(key.startswith("modeled") for key in [*row, *(k for mode in modes for k in row[mode])])
    assert math.isfinite(row["infinigen_vs_full"])
