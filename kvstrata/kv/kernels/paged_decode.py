"""Loads the compiled CPU kernels of kv/, building them on first use: decode attention read where the cache lies
(attend.h and one reader per storage), Oaken's encoder and the sparse-page writer.

`kernel()` is None where they cannot be built (no C++ compiler): callers then take the torch path (gather and
decode the blocks, then the reference attention; the torch encoder and writer). `python -m kvstrata.kv.kernels.build`
builds them (the README's set-up does).
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
import time
import warnings
from pathlib import Path

NAME = "kvstrata_paged_decode"
STALE_LOCK_S = 600  # a build takes about a minute; a lock this old was left by a build that was killed
HERE = Path(__file__).parent
SOURCES = [HERE / name for name in ("paged_decode.cpp", "integer_rows.cpp", "kivi_rows.cpp", "oaken_rows.cpp",
                                         "oaken_encode.cpp", "sparse_write.cpp")]
HEADER = HERE / "attend.h"
# -fopenmp: at::parallel_for spreads the sequences over torch's threads, and the dot products and updates over head_dim are vectorized as their pragmas allow (a float
# sum may be reassociated there); AVX2, FMA and F16C: every x86-64 server CPU of the last decade has them.
FLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"]


def _header_flag() -> str:
    """torch rebuilds an extension when its sources or flags change, not its headers: the header's hash, passed as a
    define, makes a changed header a changed flag."""
    return f"-DKVSTRATA_ATTEND_H={hashlib.sha256(HEADER.read_bytes()).hexdigest()[:16]}"


def clear_stale_lock(build_directory: Path) -> None:
    """torch waits forever on the lock file of a build that was killed part-way, so every later start would hang:
    a lock far older than a build takes is removed, with a warning."""
    lock = build_directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        warnings.warn(f"removing {lock}, left {age:.0f} s ago by a kernel build that did not finish", stacklevel=2)
        lock.unlink(missing_ok=True)


@functools.cache
def kernel():
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        clear_stale_lock(Path(_get_build_directory(NAME, False)))
        return load(name=NAME, sources=[str(s) for s in SOURCES],
                    extra_cflags=[*FLAGS, _header_flag()], verbose=False)
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as exc:  # no compiler, no headers:
        # the engine still runs, on the slower path
        warnings.warn(f"the compiled KV kernels could not be built ({exc}); using the torch path",
                      stacklevel=2)
        return None
