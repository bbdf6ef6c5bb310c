"""Builds and loads the project's C++ kernels through torch's extension mechanism (g++, cached per source and flag
set), and `python -P kvstrata/compiled_extension.py` builds them all now (the README's set-up runs it).

Three extensions (EXTENSIONS): the KV kernels (kv/kernels/: decode attention read where the cache lies, Oaken's
encoder, the sparse-page writer), the weight kernels (model/kernels/: products over GGUF's quantized blocks, and their
widening to dense weights for prefill-sized products) and CacheGen's rANS coder (cachegen/kernels/). A loader returns
None where its extension cannot be built (no compiler): callers then take their torch path (the coder:
constriction's). This module needs torch alone, so the set-up builds the kernels while pip installs the rest.
"""

from __future__ import annotations

import contextlib
import hashlib
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BUILD_NOTICE_AFTER_S = 3.0  # loading a build already made takes well under a second
STALE_LOCK_S = 600  # a build takes about two minutes on 2 cores; a lock this old was left by a build that was killed
# -fopenmp: at::parallel_for spreads work over torch's threads; AVX2, FMA and F16C: every x86-64 server CPU of the
# last decade has them.
FLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"]
KVSTRATA = Path(__file__).parent
# name: what a warning calls it, and its sources under kvstrata/
EXTENSIONS = {
    "kvstrata_paged_decode": ("KV kernels", [
        f"kv/kernels/{name}.cpp" for name in ("paged_decode", "record_rows", "record_store", "kivi_rows",
                                              "kivi_window_store", "oaken_rows", "oaken_encode", "oaken_store",
                                              "sparse_write", "infinigen_select", "gather_rows", "fetched_attention")]),
    "kvstrata_weight_kernels": ("weight kernels", [
        f"model/kernels/{name}.cpp" for name in ("block_dot", "widened_rows", "decode_layers")]),
    "kvstrata_rans": ("rANS coder", ["cachegen/kernels/rans.cpp"]),
}


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


def load_extension(name: str):
    """The compiled module `name` (one of EXTENSIONS), or None (with a warning naming it) where it cannot be built."""
    what, sources = EXTENSIONS[name]
    paths = [KVSTRATA / source for source in sources]
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        clear_stale_lock(Path(_get_build_directory(name, False)))
        flags = [*FLAGS, header_flag(paths)]
        with _building_notice(what):
            return load(name=name, sources=[str(path) for path in paths], extra_cflags=flags, verbose=False)
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as exc:  # no compiler, no headers
        warnings.warn(f"the compiled {what} could not be built ({exc}); using the torch path", stacklevel=3)
        return None


@contextlib.contextmanager
def _building_notice(what: str):
    """A load that outlasts BUILD_NOTICE_AFTER_S is compiling (or waiting on another process that is): say so on
    stderr, and when it ends, so that a first run's minutes of silence do not look like a hang."""
    started, told = time.perf_counter(), threading.Event()

    def tell() -> None:
        told.set()
        print(f"kvstrata: compiling the {what} (on first use after an install or upgrade; can take minutes)...",
              file=sys.stderr, flush=True)

    notice = threading.Timer(BUILD_NOTICE_AFTER_S, tell)
    notice.daemon = True
    notice.start()
    try:
        yield
    finally:
        notice.cancel()
        if told.is_set():
            print(f"kvstrata: compiled the {what} in {time.perf_counter() - started:.0f} s", file=sys.stderr,
                  flush=True)


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
    # side by side: one extension's last source or its link leaves a core idle that the others use
    with ThreadPoolExecutor(len(EXTENSIONS)) as pool:
        built = dict(zip(EXTENSIONS, pool.map(load_extension, EXTENSIONS)))
    failed = [EXTENSIONS[name][0] for name, module in built.items() if module is None]
    if failed:
        raise SystemExit(f"kvstrata: building the compiled {', '.join(failed)} failed (see the warnings above)")
    print("kvstrata: compiled kernels built")


if __name__ == "__main__":
    main()
