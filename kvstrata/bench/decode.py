"""The baselines of `kvstrata bench decode` (llama.cpp, transformers) on the GGUF file the engine reads.

Each runs greedy decoding after the same prompt; a step's time is the time from one new token to
the next, and the reported rate is 1 / the median step. llama.cpp runs through llama-cpp-python
(an optional extra: `pip install kvstrata[llama-cpp]`, it compiles llama.cpp for minutes) with as
many threads as torch uses, in a process of its own; transformers reads the GGUF file dequantized to
fp32, in the engine's process.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
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


LLAMA_CPP_TIMEOUT_S = 600  # loading and decoding the default model takes seconds


def llama_cpp_decoder(gguf_path: Path, prompt: list[int], steps: int,
                      threads: int) -> Callable[[], tuple[float, list[int]]] | None:
    """A function returning (median seconds per decode step, the greedy tokens) of llama.cpp decoding `steps` tokens
    after `prompt` in a process of its own (bench/llama_cpp_child.py), or None when llama-cpp-python is not
    installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    request = json.dumps({"gguf": str(gguf_path), "prompt": prompt, "steps": steps, "threads": threads})

    def decode() -> tuple[float, list[int]]:
        try:
            done = subprocess.run([sys.executable, "-m", "kvstrata.bench.llama_cpp_child", request], check=False,
                                  capture_output=True, text=True, timeout=LLAMA_CPP_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise KvstrataError(f"llama.cpp's decode took over {LLAMA_CPP_TIMEOUT_S} s") from exc
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            raise KvstrataError(f"llama.cpp's decode ended with exit status {done.returncode} and no result: "
                                f"{done.stderr.strip()[-300:]}")
        result = json.loads(lines[-1])
        return result["seconds"], result["tokens"]

    return decode


def transformers_decoder(gguf_path: Path, prompt: list[int], steps: int) -> Callable[[], tuple[float, list[int]]]:
    """The same for transformers: its model in fp32 (loaded once) and its own KV cache, one token per forward call."""
    model = transformers_model(gguf_path)

    @torch.inference_mode()
    def decode() -> tuple[float, list[int]]:
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

    return decode


def agreement(ours: list[int], theirs: list[int]) -> float:
    """Fraction of positions, up to the first difference, at which two greedy runs agree."""
    same = 0
    for a, b in zip(ours, theirs):
        if a != b:
            break
        same += 1
    return same / max(1, min(len(ours), len(theirs)))
