"""Summary statistics shared by the benchmarks."""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable

import numpy as np


def call_seconds(call: Callable[[], object], repeats: int) -> list[float]:
    """Wall times of `repeats` calls of `call`, after one untimed call that warms it up."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def minor_page_faults() -> int:
    """Pages this process has faulted in so far that needed nothing read (memory touched for the first time since
    it was mapped): each costs the kernel a fault and a clearing."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    return statistics.median(call_seconds(call, repeats))


def summarize(values: list[float], name: str, scale: float = 1.0) -> dict[str, float]:
    """mean, median, p90 and p99 of `values` * `scale`, keyed like vLLM's benchmarks (mean_ttft_ms, ...)."""
    if not values:
        return {f"{stat}_{name}": 0.0 for stat in ("mean", "median", "p50", "p90", "p99")}
    data = np.asarray(values, dtype=float) * scale
    return {
        f"mean_{name}": round(float(data.mean()), 3),
        f"median_{name}": round(float(np.median(data)), 3),
        f"p50_{name}": round(float(np.percentile(data, 50)), 3),
        f"p90_{name}": round(float(np.percentile(data, 90)), 3),
        f"p99_{name}": round(float(np.percentile(data, 99)), 3),
    }
