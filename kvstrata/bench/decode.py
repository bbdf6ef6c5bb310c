"""The baselines of `kvstrata bench decode` (llama.cpp, transformers) on the GGUF file the engine reads.

Each runs greedy decoding after the same prompt; a step's time is the time from one new token to
the next, and the reported rate is 1 / the median step. llama.cpp runs through llama-cpp-python
(an optional extra: `pip install kvstrata[llama-cpp]`, it compiles llama.cpp for minutes) with as
many threads as torch uses; transformers reads the GGUF file dequantized to fp32.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import statistics
import time
from pathlib import Path

import torch

from kvstrata.bench.transformers_model import transformers_model
from kvstrata.errors import KvstrataError


def gguf_file(source: Path) -> Path:
    """The GGUF file all three read (the engine's --model)."""
    if source.suffix != ".gguf":
        raise KvstrataError(f"bench decode compares engines on one GGUF file; --model {str(source)!r} is not a .gguf file")
    return source


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def llama_cpp_decode(gguf_path: Path, prompt: list[int], steps: int, threads: int) -> tuple[float, list[int]] | None:
    """(median seconds per decode step, the greedy tokens) of llama.cpp, or None when llama-cpp-python is
    not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(gguf_path), n_threads=threads, n_threads_batch=threads,
                n_ctx=len(prompt) + steps + 16, verbose=False)
    tokens, stamps = [], []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        stamps.append(time.perf_counter())
        tokens.append(token)
        if len(tokens) == steps + 1:
            break
    return statistics.median(b - a for a, b in itertools.pairwise(stamps)), tokens


def transformers_decode(gguf_path: Path, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """The same for transformers: its model in fp32 and its own KV cache, one token per forward call."""
    model = transformers_model(gguf_path)
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        token = out.logits[0, -1].argmax()
        tokens, times = [int(token)], []
        for _ in range(steps):
            start = time.perf_counter()
            out = model(token.view(1, 1), past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[0, -1].argmax()
            times.append(time.perf_counter() - start)
            tokens.append(int(token))
    return statistics.median(times), tokens


def agreement(ours: list[int], theirs: list[int]) -> float:
    """Fraction of positions, up to the first difference, at which two greedy runs agree."""
    same = 0
    for a, b in zip(ours, theirs):
        if a != b:
            break
        same += 1
    return same / max(1, min(len(ours), len(theirs)))
