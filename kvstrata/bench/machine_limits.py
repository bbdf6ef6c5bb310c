"""This machine's GEMM rates and memory bandwidth, measured with torch."""

from __future__ import annotations

import torch

from kvstrata.bench.stats import call_seconds


def _best_seconds(fn, repeats: int) -> float:
    """Fastest of `repeats` runs after a warm-up: a limit is what the machine can reach."""
    return min(call_seconds(fn, repeats))


def gemm_gflops(device: torch.device, size: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Matrix-multiply rate in `dtype` on square matrices of `size`."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)

    def run():
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return 2 * size**3 / _best_seconds(run, repeats) / 1e9


def read_bandwidth_gbs(device: torch.device, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second streamed from memory by a reduction over a buffer far larger than the caches."""
    data = torch.ones(megabytes * 2**20 // 4, device=device)

    def run():
        data.sum()
        if device.type == "cuda":
            torch.cuda.synchronize()

    return data.numel() * 4 / _best_seconds(run, repeats) / 1e9


def gemv_bandwidth_gbs(device: torch.device, rows: int = 49152, cols: int = 576, copies: int = 8) -> float:
    """Weight bytes per second a batch-1 linear layer streams (matrix-vector product), cycling through
    `copies` matrices so each read comes from memory, not cache."""
    weights = [torch.randn(rows, cols, device=device) for _ in range(copies)]
    x = torch.randn(1, cols, device=device)
    turn = [0]

    def run():
        turn[0] = (turn[0] + 1) % copies
        torch.nn.functional.linear(x, weights[turn[0]])
        if device.type == "cuda":
            torch.cuda.synchronize()

    return rows * cols * 4 / _best_seconds(run, 3 * copies) / 1e9
