"""Builds and loads the project's C++ kernels through torch's extension mechanism (g++, cached per source and flag
set), and `python -m kvstrata.compiled_extension` builds them all now (the README's set-up runs it).

Three extensions: the KV kernels (kv/kernels/: decode attention read where the cache lies, Oaken's encoder, the
sparse-page writer), the weight kernels (model/kernels/: products over GGUF's quantized blocks, and their widening to
dense weights for prefill-sized products) and CacheGen's rANS coder (cachegen/kernels/). A loader returns None where its extension cannot be built (no
compiler): callers then take their torch path (the coder: constriction's).
"""

from __future__ import annotations

import contextlib
import hashlib
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path

STALE_LOCK_S = 600  # a build takes about two minutes on 2 cores; a lock this old was left by a build that was killed
# -fopenmp: at::parallel_for spreads work over torch's threads; AVX2, FMA and F16C: every x86-64 server CPU of the
# last decade has them.
FLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"]


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


def header_flag(sources: list[Path]) -> str:
    """torch rebuilds an extension when its sources or flags change, not its headers: the hash of the headers beside
    the sources, passed as a define, makes a changed header a changed flag."""
    folders = sorted({source.parent for source in sources})
    headers = b"".join(path.read_bytes() for folder in folders for path in sorted(folder.glob("*.h")))
    return f"-DKVSTRATA_HEADERS={hashlib.sha256(headers).hexdigest()[:16]}"


def load_extension(name: str, sources: list[Path], what: str = "kernels"):
    """The compiled module, or None (with a warning naming `what`) where it cannot be built."""
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        clear_stale_lock(Path(_get_build_directory(name, False)))
        flags = [*FLAGS, header_flag(sources)]
        return load(name=name, sources=[str(s) for s in sources], extra_cflags=flags, verbose=False)
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as exc:  # no compiler, no headers
        warnings.warn(f"the compiled {what} could not be built ({exc}); using the torch path", stacklevel=3)
        return None


@contextlib.contextmanager
def switches_set(*switches: tuple[Callable[[bool], bool], bool]):
    """Within it each of a kernel's path switches (`allow(value)`, which returns what it was) is set to its value,
    and afterwards set back: for tests and benchmarks that check or time one code path."""
    before = [(allow, allow(value)) for allow, value in switches]
    try:
        yield
    finally:
        for allow, value in reversed(before):
            allow(value)


def main() -> None:
    from kvstrata.cachegen import entropy
    from kvstrata.kv.kernels import paged_decode
    from kvstrata.model import block_linear

    kernels = (("KV kernels", paged_decode.kernel), ("weight kernels", block_linear.kernel),
               ("rANS coder", entropy.compiled_coder))
    failed = [what for what, kernel in kernels if kernel() is None]
    if failed:
        raise SystemExit(f"kvstrata: building the compiled {', '.join(failed)} failed (see the warnings above)")
    print("kvstrata: compiled kernels built")


if __name__ == "__main__":
    main()
