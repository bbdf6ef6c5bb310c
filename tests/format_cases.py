"""Every KV format, with the options that reach its distinct code paths, built on the tiny model (kv_head_dim 64):
shared by the tests that compare one read path with another."""

from __future__ import annotations

import torch

from kvstrata import LLM
from kvstrata.kv.formats.oaken.thresholds import DEFAULT_RATIOS
from tests.conftest import FOUR_GROUPS

CASES = {
    "fp32": ("fp32", {}), "fp16": ("fp16", {}), "bf16": ("bf16", {}), "int8": ("int8", {}),
    "int4": ("int4", {}), "int4-group16": ("int4", {"int4_group_size": 16}),
    "fp8": ("fp8", {}),  # fp8_e5m2 differs from it only in its codes' meaning: tests/test_record_store.py, test_paged_kernel.py
    "int8/int4": ("int8/int4", {}),  # K and V records of two sizes and forms
    # a residual of 32 leaves each sequence's older blocks quantized and its newest in the float16 window
    "kivi4": ("kivi4", {"kivi_residual": 32}), "kivi2": ("kivi2", {"kivi_residual": 32}),
    "oaken": ("oaken", {}), "oaken-pre-rope": ("oaken", {"oaken_keys": "pre-rope"}),
    "oaken-uncentered": ("oaken", {"oaken_key_centering": False}),
    "oaken-fp16-outliers": ("oaken", {"oaken_outliers": "fp16"}),
    "oaken-unshifted": ("oaken", {"oaken_group_shift": False}),
    "oaken-4-groups": ("oaken", {"oaken_ratios": ",".join(map(str, FOUR_GROUPS))}),
}


def build(tiny_llama_kv64, oaken_calibrations, case: str, **options) -> LLM:
    kv_format, extra = CASES[case]
    ratios = FOUR_GROUPS if "oaken_ratios" in extra else DEFAULT_RATIOS
    return LLM(str(tiny_llama_kv64), kv_format=kv_format, kv_cache_memory="8MiB", threads=1, chunk_size=32,
               oaken_calibration=str(oaken_calibrations[ratios]), **extra, **options)


NONFINITE_TOKENS = (5, 6)  # the rows of `extreme_tokens` that float16 parameters cannot hold


def extreme_tokens(width: int, generator: torch.Generator) -> torch.Tensor:
    """21 tokens [21, width] for an encoder: random ones, and a zero token (2), float16's largest values (3), tiny
    values (4), a value beyond float16's range (5) and a NaN (6)."""
    x = torch.randn(21, width, generator=generator) * 4
    x[2] = 0
    x[3, :5] = 60000.0
    x[4] = 1e-6 * torch.randn(width, generator=generator)
    x[5, 1] = 1e7
    x[6, 2] = float("nan")
    return x
