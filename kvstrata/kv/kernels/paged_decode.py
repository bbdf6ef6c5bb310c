"""Loads the compiled CPU kernels of kv/, building them on first use: decode attention read where the cache lies
(attend.h and one reader per storage) and their whole-block reads, the int8, fp8 and int4 store, Oaken's encoder and
fused store, the sparse-page writer, KIVI's window store, and InfiniGen's selection of the tokens a layer fetches,
their gather and attention over them.

`kernel()` is None where they cannot be built (no C++ compiler): callers then take the torch path (gather and
decode the blocks, then the reference attention; the torch encoder and writer). The README's set-up builds them
(kvstrata/compiled_extension.py).
"""

from __future__ import annotations

import functools

from kvstrata.compiled_extension import load_extension, switches_set
from kvstrata.kv import fused_decode


@functools.cache
def kernel():
    compiled = load_extension("kvstrata_paged_decode")
    if compiled is not None:
        fused_decode.register_fake()
    return compiled


def kernel_paths(avx512: bool):
    """Within it the compiled readers may take their AVX-512 code where the CPU has it (Oaken's dense values), else
    their AVX2 code: for tests that check the AVX2 code on a CPU with both."""
    return switches_set((kernel().allow_avx512, avx512))
