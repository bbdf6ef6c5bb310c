"""One engine serving the same batch of requests round after round, as a server does: per round, the page faults and
seconds of its steps with prompt tokens and of its steps of decodes alone, and the process's resident memory (its
peak during the round, and after it). With `--no-keep-freed-memory` the C library's allocator keeps its defaults
(docs/BENCHMARKS.md, "Freed memory kept for the next step"); the setting is the whole process's, so each setting is a
command of its own:

    .venv/bin/python -m benchmarks.freed_memory > benchmarks/results/freed_memory_on.json
    .venv/bin/python -m benchmarks.freed_memory --no-keep-freed-memory > benchmarks/results/freed_memory_off.json

Each round: `--requests` prompts of `--prompt-len` tokens (consecutive windows of the Python tutorial) added at once,
each generating `--output-len` tokens greedily; the prefix cache is reset before each round, so every round
prefills every prompt.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import psutil

from kvstrata.bench.memory import peak_rss
from kvstrata.bench.report import machine_info
from kvstrata.bench.stats import minor_page_faults
from kvstrata.bench.workload import prompts_from_text
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams

TEXT = Path(__file__).parent / "data" / "python_tutorial.txt"


def one_round(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict:
    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    steps = {kind: {"steps": 0, "seconds": 0.0, "page_faults": 0} for kind in ("with_prompt_tokens", "decodes_alone")}
    with peak_rss() as peak:
        while engine.has_unfinished_requests():
            faults, start = minor_page_faults(), time.perf_counter()
            engine.step()
            seconds, faults = time.perf_counter() - start, minor_page_faults() - faults
            kind = steps["with_prompt_tokens" if engine.step_stats[-1].prefill_tokens else "decodes_alone"]
            kind["steps"] += 1
            kind["seconds"] += seconds
            kind["page_faults"] += faults
    for kind in steps.values():
        kind["seconds"] = round(kind["seconds"], 3)
    tokens = len(prompts) * (len(prompts[0]) + output_len)
    return {**steps, "tokens_per_s": round(tokens / sum(k["seconds"] for k in steps.values()), 1),
            "peak_rss_mib": round(peak[0] / 2**20, 1),
            "rss_mib_after": round(psutil.Process().memory_info().rss / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-keep-freed-memory", action="store_true", help="the engine's --no-keep-freed-memory")
    args = parser.parse_args()
    for name in ("requests", "prompt_len", "output_len", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    engine = LLMEngine(EngineConfig(keep_freed_memory=not args.no_keep_freed_memory))
    prompts = prompts_from_text(engine.tokenizer, args.requests, args.prompt_len, TEXT)
    rounds = [one_round(engine, prompts, args.output_len) for _ in range(args.rounds)]
    print(json.dumps({"benchmark": "freed_memory", "machine": machine_info(), "model": engine.loaded.name,
                      "keep_freed_memory": engine.config.keep_freed_memory, "workload": vars(args),
                      "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
