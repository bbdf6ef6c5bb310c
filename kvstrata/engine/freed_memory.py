"""Memory the process frees kept for its next use (glibc's malloc), instead of handed back to the kernel.

torch takes a CPU tensor's memory from the C library's allocator, and every step of the engine allocates and frees
buffers of the same sizes again: a 1,024-token prompt chunk's MLP activations alone are [1,024, 3,072] float32, 12
MiB. By default glibc often hands such blocks back when they are freed (large ones are mapped and unmapped on their
own, and the heap's free top is trimmed; how often depends on thresholds it moves as the process frees blocks and on
what else lies in the heap), so the next step touches fresh pages, each 4 KiB page a fault and a clearing
by the kernel: 1-2 million faults a round in the prompt steps of 32 requests of 256 tokens served again and again
(docs/BENCHMARKS.md, "Freed memory kept for the next step").
"""

from __future__ import annotations

import ctypes
import platform

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap and stay there when freed: the largest mapping threshold glibc accepts on
# a 64-bit system. Larger ones (a model's weights while they load, one very long prompt's activations) are still
# mapped on their own and handed back when freed.
KEPT_BLOCK_BYTES = 32 * 2**20
# Free memory at the top of a heap is handed back only beyond this (the largest value mallopt takes).
TRIM_ABOVE_BYTES = 2**31 - 1


def keep_freed_memory() -> bool:
    """Have malloc keep freed blocks of up to KEPT_BLOCK_BYTES for reuse, in every thread of the process and for as
    long as it runs. False where the C library is not glibc or refused a setting."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, KEPT_BLOCK_BYTES)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                          TRIM_ABOVE_BYTES))
