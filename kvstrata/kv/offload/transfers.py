"""What crosses between the host pool and the compute device, counted per layer (`OffloadStats`).

`copied_bytes` are the bytes of the tensors actually copied to the device (decoded K/V, padding rows of whole
blocks included); `stored_form_bytes` are what the same rows occupy in the host pool's format, what a device-
side decoder would move. Decode reads are also counted in rows (one token of one KV head): the fraction of
the cached KV a layer fetched is `decode_fetched_rows / decode_cached_rows` (under h2o, which moves nothing, the rows
its decodes attended).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

import numpy as np
import torch

from kvstrata.kv.offload.link import LinkModel


class OffloadStats:
    def __init__(self, num_layers: int, link: LinkModel):
        self.link = link
        self.copied_bytes = np.zeros(num_layers, dtype=np.int64)  # host pool -> device, per layer
        self.stored_form_bytes = np.zeros(num_layers, dtype=np.int64)
        self.written_bytes = np.zeros(num_layers, dtype=np.int64)  # device -> host pool (new K/V)
        self.decode_fetched_rows = np.zeros(num_layers, dtype=np.int64)
        self.decode_cached_rows = np.zeros(num_layers, dtype=np.int64)
        self.selected_per_head = np.zeros(num_layers, dtype=np.int64)  # sum over decodes of a query head's count
        self.decodes = np.zeros(num_layers, dtype=np.int64)  # decode (sequence, layer) selections counted above
        self.modeled_transfer_s = np.zeros(num_layers)  # the link model's time of every copy, per layer
        self.transfers = 0
        self.copy_seconds = 0.0  # measured: host time copying fetched K/V to the device (on a GPU: staging, issuing)
        self.recall_mass = 0.0  # diagnostics: attention mass of the fetched keys, summed over query heads
        self.recall_heads = 0

    def fetched(self, layer: int, copied_bytes: int, stored_form_bytes: int) -> None:
        self.copied_bytes[layer] += copied_bytes
        self.stored_form_bytes[layer] += stored_form_bytes
        self.modeled_transfer_s[layer] += self.link.seconds(stored_form_bytes)
        self.transfers += 1

    def copy_to(self, buffers: WorkingBuffers, names: tuple[str, ...], *tensors: torch.Tensor,
                stream: torch.cuda.Stream | None = None) -> tuple[torch.Tensor, ...]:
        """The tensors copied into the named device buffers (on `stream`, a GPU's side stream, where given), the
        time it took the host counted (on a GPU the copies are asynchronous: staging them, not their transfer)."""
        with self.copying():
            return tuple(buffers.copy(name, x, stream) for name, x in zip(names, tensors))

    @contextmanager
    def copying(self):
        """Counts the time the host spends in the block as copying to the device."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.copy_seconds += time.perf_counter() - start

    def decode_rows(self, layer: int, fetched: int, cached: int) -> None:
        self.decode_fetched_rows[layer] += fetched
        self.decode_cached_rows[layer] += cached

    def summary(self) -> dict:
        cached = self.decode_cached_rows
        fraction = np.divide(self.decode_fetched_rows, cached, out=np.zeros(len(cached)), where=cached > 0)
        return {
            "link": self.link.name,
            "copied_bytes": int(self.copied_bytes.sum()),
            "stored_form_bytes": int(self.stored_form_bytes.sum()),
            "written_bytes": int(self.written_bytes.sum()),
            "modeled_transfer_s": float(self.modeled_transfer_s.sum()),
            "copy_seconds": self.copy_seconds,
            "decode_fraction_fetched": float(self.decode_fetched_rows.sum() / max(cached.sum(), 1)),
            "decode_fraction_fetched_per_layer": [round(float(f), 4) for f in fraction],
            "tokens_per_query_head": (float(self.selected_per_head.sum() / self.decodes.sum())
                                      if self.decodes.sum() else None),
            "recall_of_attention_mass": self.recall_mass / self.recall_heads if self.recall_heads else None,
        }


class WorkingBuffers:
    """Device memory kept from step to step for the K/V copied out of the host pool, one buffer per name (FlexGen
    keeps such buffers too): a copy lands in memory already mapped, never in a fresh allocation.

    On a GPU the host-side rows are first staged in pinned memory (torch's caching host allocator, which keeps a
    staging block until its copy is done), so that the copy is a DMA the host does not wait for; the InfiniGen
    authors' code keeps a pinned buffer for the same reason."""

    def __init__(self, device: torch.device):
        self.device = device
        self._flat: dict[str, torch.Tensor] = {}

    def copy(self, name: str, x: torch.Tensor, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """A copy of host tensor `x` in buffer `name` with x's shape, and its strides where its elements fill their
        span (heads-outermost gathers stay that way); valid until the buffer is used again. On a GPU, issued on
        `stream` where given (else the current one); the caller orders its readers after it."""
        if self.device.type == "cuda":
            x = x.pin_memory()
        flat = self._flat_buffer(name, x.numel(), x.dtype)
        out = flat.as_strided(x.shape, x.stride()) if _dense(x) else flat[: x.numel()].view(x.shape)
        if stream is None:
            return out.copy_(x, non_blocking=True)
        flat.record_stream(stream)  # a buffer given up is not handed out again before this copy has written it
        with torch.cuda.stream(stream):
            return out.copy_(x, non_blocking=True)

    def empty(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Buffer `name` as a contiguous tensor of `shape` to write into (what it held is lost)."""
        numel = math.prod(shape)
        return self._flat_buffer(name, numel, dtype)[:numel].view(shape)

    def _flat_buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Buffer `name` with room for `numel` elements of `dtype`; a larger one (by a quarter, so that contexts
        growing step by step rarely need another) where it had less room or another dtype."""
        flat = self._flat.get(name)
        if flat is None or flat.numel() < numel or flat.dtype != dtype:
            flat = self._flat[name] = torch.empty(int(1.25 * numel), dtype=dtype, device=self.device)
        return flat


def _dense(x: torch.Tensor) -> bool:
    """Whether x's elements fill exactly x.numel() places in some order of its dimensions (a permuted contiguous
    tensor), so the same strides fit a buffer of that size."""
    expected = 1
    for dim in sorted(range(x.dim()), key=x.stride):
        if x.shape[dim] != 1 and x.stride(dim) != expected:
            return False
        expected *= x.shape[dim]
    return True


def to_host(host: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors in host memory, the host waiting for a GPU once for all of them (each copy is queued first)."""
    copies = [x.to(host, non_blocking=True) for x in tensors]
    on_gpu = [x.device for x in tensors if x.is_cuda]
    if on_gpu:
        torch.cuda.current_stream(on_gpu[0]).synchronize()
    return copies


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `x` on `device`; to a GPU through pinned memory, so that neither side waits for the other."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)
