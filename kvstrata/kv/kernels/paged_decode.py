"""Loads the compiled CPU kernels of kv/, building them on first use: decode attention read where the cache lies
(attend.h and one reader per storage) and their whole-block reads, the int8, fp8 and int4 store, Oaken's encoder and
fused store, the sparse-page writer, KIVI's window store, and InfiniGen's selection of the tokens a layer fetches,
their gather and attention over them.

`kernel()` is None where they cannot be built (no C++ compiler): callers then take the torch path (gather and
decode the blocks, then the reference attention; the torch encoder and writer). `python -m kvstrata.compiled_extension`
builds them (the README's set-up does).
"""

from __future__ import annotations

import functools
from pathlib import Path

from kvstrata.compiled_extension import load_extension, switches_set
from kvstrata.kv import fused_decode

NAME = "kvstrata_paged_decode"
HERE = Path(__file__).parent
SOURCES = [HERE / name for name in ("paged_decode.cpp", "record_rows.cpp", "record_store.cpp", "kivi_rows.cpp",
                                    "kivi_window_store.cpp", "oaken_rows.cpp", "oaken_encode.cpp", "oaken_store.cpp",
                                    "sparse_write.cpp", "infinigen_select.cpp", "gather_rows.cpp",
                                    "fetched_attention.cpp")]


@functools.cache
def kernel():
    compiled = load_extension(NAME, SOURCES, what="KV kernels")
    if compiled is not None:
        fused_decode.register_fake()
    return compiled


def kernel_paths(avx512: bool):
    """Within it the compiled readers may take their AVX-512 code where the CPU has it (Oaken's dense values), else
    their AVX2 code: for tests that check the AVX2 code on a CPU with both."""
    return switches_set((kernel().allow_avx512, avx512))
