"""Loads the compiled paged decode-attention kernel (paged_decode.cpp), building it on first use.

`kernel()` is None where it cannot be built (no C++ compiler): callers then gather the blocks and use the
torch reference path. `python -m kvstrata.kv.kernels.build` builds it (the README's set-up does).
"""

from __future__ import annotations

import functools
import subprocess
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("paged_decode.cpp")
# -fopenmp: at::parallel_for spreads the sequences over torch's threads, and the dot products and updates over head_dim are vectorized as their pragmas allow (a float
# sum may be reassociated there); AVX2 and FMA: every x86-64 server CPU of the last decade has them.
FLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma"]


@functools.cache
def kernel():
    try:
        from torch.utils.cpp_extension import load

        return load(name="kvstrata_paged_decode", sources=[str(SOURCE)], extra_cflags=FLAGS, verbose=False)
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as exc:  # no compiler, no headers:
        # the engine still runs, on the slower path
        warnings.warn(f"the compiled paged decode attention could not be built ({exc}); using the torch path",
                      stacklevel=2)
        return None

