"""Where a batch-1 decode step's time goes (`bench decode`'s `kvstrata_step_split_ms`): the model's layers (the
embedding, every layer and the final norm; under --compile the one graph with its guard checks), the LM head,
and the rest of the engine's step (scheduling, the step's metadata, sampling, outputs), by timing the model's two
calls while the decode steps run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def timed_model_calls(model: nn.Module) -> Iterator[dict[str, list[float]]]:
    """Seconds of each `model.forward` over one token ("layers") and each `model.compute_logits` ("head")."""
    times: dict[str, list[float]] = {"layers": [], "head": []}
    forward, compute_logits = model.forward, model.compute_logits

    def timed_forward(input_ids, *args):
        start = time.perf_counter()
        out = forward(input_ids, *args)
        if len(input_ids) == 1:  # a decode step, not the prefill
            times["layers"].append(time.perf_counter() - start)
        return out

    def timed_logits(hidden):
        start = time.perf_counter()
        out = compute_logits(hidden)
        times["head"].append(time.perf_counter() - start)
        return out

    model.forward, model.compute_logits = timed_forward, timed_logits  # instance attributes shadow the methods
    try:
        yield times
    finally:
        del model.forward, model.compute_logits


def step_split_ms(step_seconds: float, times: dict[str, list[float]]) -> dict[str, float]:
    """Medians in milliseconds; "rest" is the step's median less the two others."""
    layers, head = (statistics.median(times[name]) for name in ("layers", "head"))
    return {"step": step_seconds * 1e3, "layers": layers * 1e3, "head": head * 1e3,
            "rest": (step_seconds - layers - head) * 1e3}
