"""Every KV format, with the options that reach its distinct code paths, built on the tiny model (kv_head_dim 64):
shared by the tests that compare one read path with another."""

from __future__ import annotations

from kvstrata import LLM
from kvstrata.kv.formats.oaken.thresholds import DEFAULT_RATIOS
from tests.conftest import FOUR_GROUPS

CASES = {
    "fp32": ("fp32", {}), "fp16": ("fp16", {}), "bf16": ("bf16", {}), "int8": ("int8", {}),
    "int4": ("int4", {}), "int4-group16": ("int4", {"int4_group_size": 16}),
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
