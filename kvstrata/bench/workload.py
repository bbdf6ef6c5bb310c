"""Prompts for benchmarks, cut from a text file, and running them together."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from kvstrata.data import EMMA
from kvstrata.engine.kv_setup import engine_storage_layout
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.errors import KvstrataError


def read_text(path: Path) -> str:
    """A text file's text, UTF-8; an empty one is refused (every command reads a text to run the model on it)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KvstrataError(f"cannot read text file {path}: {exc}") from exc
    if not text.strip():
        raise KvstrataError(f"text file {path} holds no text; give a file with the text to run the model on")
    return text


def prompts_from_text(tokenizer, count: int, length: int, text_file: Path = EMMA) -> list[list[int]]:
    """`count` prompts of exactly `length` tokens: consecutive windows of the text."""
    ids = tokenizer.encode(read_text(text_file))
    if len(ids) < count * length:
        raise KvstrataError(f"{text_file} has {len(ids)} tokens, fewer than {count} x {length}")
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def kv_budget_for(engine, requests: int, tokens: int) -> int:
    """Bytes of a KV pool that holds exactly `requests` requests of `tokens` tokens each in `engine`'s storage (its
    format and dtype), in whole blocks, as the engine sizes its pool."""
    block_size = engine.config.block_size
    per_token = engine_storage_layout(engine, getattr(torch, engine.config.dtype)).bytes_per_token
    return requests * -(-tokens // block_size) * math.ceil(block_size * per_token)


def run_together(engine, prompts: list[list[int]], params: list) -> list:
    """Each prompt's final output (prompt i with params[i]), every request sent at once and run to its end."""
    ids = [engine.add_request(prompt, one) for prompt, one in zip(prompts, params)]
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    return [finished[request_id] for request_id in ids]


def warm_up(engines, prompt: list[int]) -> None:
    """Pay each engine's one-time costs (the compiled decode) before anything is timed."""
    for engine in engines:
        run_together(engine, [prompt], [SamplingParams(max_tokens=2, temperature=0.0)])


def take_turns(engines: dict, rounds: int, run: Callable, alternate: bool = False) -> dict[str, list]:
    """`run(engine)` for each engine in turn, `rounds` times over, so that the machine's drift falls on all alike
    (with `alternate`, each round in the order opposite to the round before); each engine's results, by its name."""
    results = {name: [] for name in engines}
    for round_index in range(rounds):
        names = list(engines)[:: -1 if alternate and round_index % 2 else 1]
        for name in names:
            results[name].append(run(engines[name]))
    return results


def medians(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per name, the median over its runs of each figure."""
    return {name: {key: statistics.median(run[key] for run in one) for key in one[0]} for name, one in runs.items()}


def generate_together(engine, prompts: list[list[int]], params: list) -> list[list[int]]:
    """Each prompt's output tokens, as `run_together` runs them."""
    return [list(out.token_ids) for out in run_together(engine, prompts, params)]


def parse_length(spec: str, flag: str):
    """A token count as a function of a random.Random: `N` (fixed), `uniform:LOW:HIGH` (inclusive), or
    `lognormal:MEDIAN:SIGMA:LOW:HIGH` (a heavy tail: exp of a normal with mean ln MEDIAN and deviation SIGMA,
    rounded and clipped to [LOW, HIGH])."""
    parts = str(spec).split(":")
    try:
        if len(parts) == 1 and int(parts[0]) > 0:
            value = int(parts[0])
            return lambda rng: value
        if len(parts) == 3 and parts[0] == "uniform" and 0 < int(parts[1]) <= int(parts[2]):
            low, high = int(parts[1]), int(parts[2])
            return lambda rng: rng.randint(low, high)
        if len(parts) == 5 and parts[0] == "lognormal":
            median, sigma, low, high = float(parts[1]), float(parts[2]), int(parts[3]), int(parts[4])
            if median > 0 and sigma >= 0 and 0 < low <= high:
                return lambda rng: min(max(round(rng.lognormvariate(math.log(median), sigma)), low), high)
    except ValueError:
        pass
    raise KvstrataError(f"--{flag} {spec!r} is not a positive N, uniform:LOW:HIGH or lognormal:MEDIAN:SIGMA:LOW:HIGH")


def sample_requests(tokenizer, count: int, prompt_len, output_len, text_file: Path, seed: int):
    """(prompt token ids, output length) pairs; prompts are windows at random places in the text."""
    import random

    ids = tokenizer.encode(read_text(text_file))
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        length = prompt_len(rng)
        if length >= len(ids):
            raise KvstrataError(f"{text_file} has {len(ids)} tokens, too few for a {length}-token prompt")
        start = rng.randrange(len(ids) - length)
        requests.append((ids[start : start + length], output_len(rng)))
    return requests
