"""Where a decode step spends its time: kvstrata's paged cache against transformers.

    .venv/bin/python -m benchmarks.profile_decode --batch 32 --context 320
    .venv/bin/python -m benchmarks.profile_decode --batch 1 --context 128 --weights auto
    .venv/bin/python -m benchmarks.profile_decode --batch 8 --context 4096 --weights auto --kv-offload infinigen --no-transformers

Both run the default model's decode step for `batch` sequences at `context` tokens of context,
under torch.profiler; prints one JSON document with the step time and the top operators of each.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvstrata.bench.report import machine_info
from kvstrata.bench.step_timer import StepTimer
from kvstrata.bench.transformers_model import transformers_model
from kvstrata.bench.workload import prompts_from_text
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine

STEPS = 3


def top_ops(prof, steps: int, rows: int = 8) -> list[dict]:
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return [{"op": e.key, "ms_per_step": round(e.self_cpu_time_total / 1000 / steps, 2),
             "share": round(e.self_cpu_time_total / total, 3), "calls_per_step": round(e.count / steps)}
            for e in events]


def op_calls_per_step(prof, steps: int) -> int:
    return round(sum(e.count for e in prof.key_averages()) / steps)


def kvstrata_step(engine: LLMEngine, prompts: list[list[int]], context: int) -> dict:
    timer = StepTimer(engine)
    work = [(timer.sequence(p, cached=context), 1) for p in prompts]
    seconds = timer.time(work, repeats=STEPS)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            timer._run(work)
    timer.release()
    return {"step_ms": round(seconds * 1000, 1), "op_calls_per_step": op_calls_per_step(prof, STEPS),
            "top_ops": top_ops(prof, STEPS)}


@torch.inference_mode()
def transformers_step(engine: LLMEngine, prompts: list[list[int]], context: int) -> dict:
    model = transformers_model(engine.loaded.source)
    ids = torch.tensor([p[:context] for p in prompts])
    cache = model(ids, use_cache=True).past_key_values
    step_ids = torch.tensor([[p[context]] for p in prompts])

    def step():
        model(step_ids, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # drop the appended token, so every timed step appends to the same `context`-token cache

    times = []
    for _ in range(STEPS + 1):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            step()
    return {"step_ms": round(sorted(times[1:])[STEPS // 2] * 1000, 1), "op_calls_per_step": op_calls_per_step(prof, STEPS),
            "top_ops": top_ops(prof, STEPS)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--weights", default="fp32", help="kvstrata's --weights (default: fp32, transformers' form)")
    parser.add_argument("--compile", action="store_true", help="kvstrata's --compile")
    parser.add_argument("--kv-offload", default="none", help="kvstrata's --kv-offload (default: none)")
    parser.add_argument("--no-transformers", action="store_true", help="profile kvstrata alone")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(enable_prefix_caching=False, weights=args.weights, compile=args.compile,
                                    kv_offload=args.kv_offload))
    prompts = prompts_from_text(engine.tokenizer, args.batch, args.context + 1)
    report = {"benchmark": "profile_decode", "machine": machine_info(), "model": engine.loaded.name,
              "workload": vars(args), "kvstrata": kvstrata_step(engine, prompts, args.context)}
    if not args.no_transformers:
        report["transformers"] = transformers_step(engine, prompts, args.context)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
