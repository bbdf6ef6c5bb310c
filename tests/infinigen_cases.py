"""What the InfiniGen and offload tests share: a small-cache engine for a tiny model, seeded random prompts, greedy
generation step by step, and the settings under which InfiniGen selects every cached token."""

from __future__ import annotations

import math

import torch

from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams

EVERYTHING = {"infinigen_alpha": math.inf, "infinigen_max_fraction": 1.0, "infinigen_full_layers": 1}


def engine_for(model, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), **{"kv_cache_memory": "4MiB", "threads": 1, **options}))


def random_prompts(seed: int, *lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=gen).tolist() for n in lengths]


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 10) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seqs = [engine._sequences[engine.add_request(p, params)] for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return [seq.token_ids[len(p):] for seq, p in zip(seqs, prompts)]
