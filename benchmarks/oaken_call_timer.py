"""Where a run's time goes, without a sampling profiler: chosen methods are swapped for timing wrappers while
the block runs (and restored after), and the seconds spent inside each are added up by label."""

from __future__ import annotations

import functools
import importlib
import time
from collections import defaultdict
from typing import Self

# label -> (module, attribute path): a function of a module, or a method of a class in it. Missing ones are skipped.
CACHE_CALLS = {
    "store (incl. encode)": [("kvstrata.kv.paged_cache", "PagedKVCache.store"),
                             ("kvstrata.kv.quantized_cache", "QuantizedPagedKVCache.store"),
                             ("kvstrata.kv.kivi_cache", "KiviPagedKVCache.store")],
    # every read of a step's keys goes through one of these (the float storage copies whole blocks itself; the
    # quantized ones read whole blocks out with their compiled readers)
    "gather (incl. decode)": [("kvstrata.kv.storage", "KVStorage.gather_keys"),
                              ("kvstrata.kv.paged_cache", "PagedKVCache.gather_keys"),
                              ("kvstrata.kv.quantized_cache", "QuantizedPagedKVCache.gather_keys"),
                              ("kvstrata.kv.kivi_cache", "KiviPagedKVCache.gather_keys")],
    "encode": [("kvstrata.kv.formats.scaled_bytes", "ScaledByteFormat.encode"),
               ("kvstrata.kv.formats.integer", "Int4Format.encode"),
               ("kvstrata.kv.formats.oaken.format", "OakenFormat.encode")],
    "decode": [("kvstrata.kv.formats.scaled_bytes", "ScaledByteFormat.decode"),
               ("kvstrata.kv.formats.integer", "Int4Format.decode"),
               ("kvstrata.kv.formats.oaken.format", "OakenFormat.decode")],
    "attention math": [("kvstrata.kv.attention_policy", "attend")],
    # decodes read where the blocks lie (kv/kernels): decoding and attention math in one call
    "in-place decode attention": [("kvstrata.kv.paged_cache", "PagedKVCache.attend_in_place"),
                                  ("kvstrata.kv.quantized_cache", "QuantizedPagedKVCache.attend_in_place"),
                                  ("kvstrata.kv.kivi_cache", "KiviPagedKVCache.attend_in_place")],
}


class CallTimer:
    def __init__(self, calls: dict[str, list[tuple[str, str]]] = CACHE_CALLS):
        self.calls = calls
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._undo: list = []
        self._inside: dict[str, bool] = defaultdict(bool)  # a call of the label is being timed

    def _wrap(self, label: str, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            if self._inside[label]:  # a wrapped method calling another of its label (an override its base's)
                return function(*args, **kwargs)
            self._inside[label] = True
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.counts[label] += 1
                self._inside[label] = False

        return timed

    def __enter__(self) -> Self:
        for label, targets in self.calls.items():
            for module_name, path in targets:
                try:
                    owner = importlib.import_module(module_name)
                except ImportError:
                    continue
                *parents, name = path.split(".")
                for parent in parents:
                    owner = getattr(owner, parent, None)
                if owner is None or name not in vars(owner):  # only what the owner itself defines
                    continue
                original = vars(owner)[name]
                setattr(owner, name, self._wrap(label, original))
                self._undo.append((owner, name, original))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo = []

    def report(self, wall: float) -> dict:
        return {label: {"seconds": round(s, 3), "share_of_wall": round(s / wall, 4), "calls": self.counts[label]}
                for label, s in self.seconds.items()}
