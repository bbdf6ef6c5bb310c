"""Several LoRA adapters in one step (model/lora.py): each packed token row gets the update of its request's
adapter, or none. A forward hook on every fused projection of a Llama-family model adds, for each adapter in the
step, (x[rows] @ A.T) @ B.T to the projection's output at that adapter's rows; the base weights are shared by all
rows and never changed, so the base model's rows in the same step get no update.

A step's rows are set before the model runs and cleared after (ModelRunner.forward); with none set, the hooks add
nothing, and steps without adapter rows keep the compiled whole-model decode (model/llama.py `_native_for`), which
does not run the projections as modules (a step with adapter rows runs all its rows through torch's layers).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from kvstrata.errors import KvstrataError
from kvstrata.model.config import LLAMA_FAMILY, ModelConfig
from kvstrata.model.lora import PARTS, LoRAAdapter, load_lora_adapter

FUSED_PROJECTIONS = {fused: parent for parent, fused, _ in PARTS.values()}  # the model's, and the block holding it


class LoRALayers:
    """The adapters a model has loaded, by name, and the rows of the step in flight that run each."""

    def __init__(self, model: nn.Module, config: ModelConfig, device: torch.device, dtype: torch.dtype):
        """`dtype`: of the updates' products (EngineConfig.lora_dtype)."""
        if config.architecture not in LLAMA_FAMILY:
            raise KvstrataError(f"LoRA adapters run on {', '.join(LLAMA_FAMILY)} models, not {config.architecture!r}")
        self.config, self.device, self.dtype = config, device, dtype
        # read by the engine thread, changed by the server's (load, unload): each change under the lock, and readers
        # that iterate take a copy
        self.adapters: dict[str, LoRAAdapter] = {}
        self._changing = threading.Lock()
        # the digest each name ever stood for: a name unloaded may come back only for the same weights, so that
        # nothing that holds the name (a beam search between rounds) finds other weights under it
        self._digests: dict[str, bytes] = {}
        self.step_spans: list[tuple[LoRAAdapter, int, int]] = []  # the step's rows [start, end) on each adapter
        for index, layer in enumerate(model.layers):
            for fused, parent in FUSED_PROJECTIONS.items():
                module = getattr(getattr(layer, parent), fused)
                module.register_forward_hook(functools.partial(self._add_updates, (index, fused)))
        model.lora = self

    @classmethod
    def of(cls, model: nn.Module, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LoRALayers:
        """The model's LoRA layers: those of an engine built on the same weights before (a calibration twin, a
        benchmark's engines, which run one at a time), else new ones."""
        if getattr(model, "lora", None) is None:  # OPT has no such attribute: the constructor refuses it
            return cls(model, config, device, dtype)
        if model.lora.dtype != dtype:
            theirs, asked = (str(d).removeprefix("torch.") for d in (model.lora.dtype, dtype))
            raise KvstrataError(f"these weights already serve LoRA adapters with lora_dtype {theirs}, not {asked}")
        return model.lora

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """Load the adapter at `path` as `name`; loading a name again from the same directory returns the one
        loaded."""
        if not isinstance(name, str) or not name:
            raise KvstrataError(f"a LoRA adapter's name must be a non-empty string, got {name!r}")
        try:
            directory = Path(path).expanduser().resolve()
        except (OSError, RuntimeError, ValueError) as exc:  # a loop of links, a NUL in the path, ...
            raise KvstrataError(f"LoRA adapter path {path!r} cannot be read: {exc}") from None
        adapter = self.adapters.get(name)
        if adapter is None:
            try:  # outside the lock: it reads and checks the files
                adapter = load_lora_adapter(name, directory, self.config, self.device, self.dtype)
            except (OSError, TypeError, ValueError, RuntimeError) as exc:
                if isinstance(exc, KvstrataError):
                    raise
                raise KvstrataError(f"LoRA adapter {directory}: not readable ({type(exc).__name__}: {exc})") from None
        with self._changing:  # another load of this name may have ended meanwhile
            if self._digests.setdefault(name, adapter.digest) != adapter.digest:
                raise KvstrataError(f"LoRA adapter name {name!r} stood for other weights before; give these another "
                                    f"name")
            loaded = self.adapters.setdefault(name, adapter)
        if loaded.path != directory:
            raise KvstrataError(f"LoRA adapter name {name!r} is already loaded from {loaded.path}, not {directory}")
        return loaded

    def unload(self, name: str) -> None:
        """Forget adapter `name`: later requests cannot name it; those running keep it to their end (a beam search's
        rounds are requests of their own, so its next round fails)."""
        with self._changing:
            self.adapter(name)
            del self.adapters[name]

    def adapter(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            known = ", ".join(dict(self.adapters)) or "none"
            raise KvstrataError(f"LoRA adapter {name!r} is not loaded (loaded: {known})")
        return adapter

    def begin_step(self, entries: Sequence[tuple[LoRAAdapter | None, int]]) -> None:
        """The step's packed rows, entry by entry in order: each entry's adapter (None: the base model) and its
        number of rows. Neighbouring entries on one adapter make one span of rows (the runner puts a step's decodes
        on one adapter side by side)."""
        spans: list[tuple[LoRAAdapter, int, int]] = []
        start = 0
        for adapter, count in entries:
            if adapter is not None:
                if spans and spans[-1][0] is adapter and spans[-1][2] == start:
                    spans[-1] = (adapter, spans[-1][1], start + count)
                else:
                    spans.append((adapter, start, start + count))
            start += count
        self.step_spans = spans

    def end_step(self) -> None:
        self.step_spans = []

    @property
    def active(self) -> bool:
        """Whether the step in flight has rows on an adapter."""
        return bool(self.step_spans)

    def _add_updates(self, key: tuple[int, str], module: nn.Module, inputs: tuple, output: torch.Tensor):
        """Each adapter's update added to its rows of the projection's output, in place (the output is the
        projection's own new tensor)."""
        for adapter, start, end in self.step_spans:
            update = adapter.updates.get(key)
            if update is None:
                continue
            projected = inputs[0][start:end].to(self.dtype) @ update.a.T
            for part in update.parts:
                output[start:end, part.outputs] += (projected[:, part.ranks] @ part.b.T).to(output.dtype)
        return output if self.step_spans else None
