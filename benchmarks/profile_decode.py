"""Where a decode step spends its time: kvstrata's paged cache against transformers.

    .venv/bin/python -m benchmarks.profile_decode --batch 32 --context 320
    .venv/bin/python -m benchmarks.profile_decode --batch 1 --context 128 --weights auto
    .venv/bin/python -m benchmarks.profile_decode --batch 8 --context 4096 --weights auto --kv-offload infinigen --no-transformers
    .venv/bin/python -m benchmarks.profile_decode --device cuda --batch 8 --context 1024 --kv-format fp32,int8,int4,oaken --no-transformers
    .venv/bin/python -m benchmarks.profile_decode --device cuda ... --no-paged-kernel   (the formats' torch path)

Both run the default model's decode step for `batch` sequences at `context` tokens of context,
under torch.profiler; prints one JSON document with the step time and the top operators of each
(kvstrata's once per `--kv-format`). On a GPU it also counts, per step, the CUDA kernels launched and
the times the host waited for the device (torch's sync debug mode): where a small model's step is
bound by launching work rather than by the GPU doing it, these set the step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from kvstrata.bench.report import machine_info
from kvstrata.bench.step_timer import StepTimer
from kvstrata.bench.transformers_model import transformers_model
from kvstrata.bench.workload import prompts_from_text
from kvstrata.config import DEVICES, EngineConfig
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


def host_waits_per_step(timer: StepTimer, work) -> float:
    """Times per step the host waited for the GPU (each synchronizing call warns once in torch's sync debug mode)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(STEPS):
                timer._run(work)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return round(sum("synchroniz" in str(w.message) for w in caught) / STEPS, 1)


def kvstrata_step(engine: LLMEngine, prompts: list[list[int]], context: int, timed_steps: int) -> dict:
    timer = StepTimer(engine)
    work = [(timer.sequence(p, cached=context), 1) for p in prompts]
    seconds = timer.time(work, repeats=timed_steps)
    on_gpu = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(STEPS):
            timer._run(work)
    figures = {"kv_format": engine.config.kv_format, "step_ms": round(seconds * 1000, 1),
               "op_calls_per_step": op_calls_per_step(prof, STEPS)}
    if on_gpu:
        kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
        figures |= {"cuda_kernels_per_step": round(kernels / STEPS), "host_waits_per_step": host_waits_per_step(timer, work)}
    timer.release()
    return figures | {"top_ops": top_ops(prof, STEPS)}


@torch.inference_mode()
def transformers_step(engine: LLMEngine, prompts: list[list[int]], context: int) -> dict:
    device = engine.device
    model = transformers_model(engine.loaded.source).to(device)
    ids = torch.tensor([p[:context] for p in prompts], device=device)
    cache = model(ids, use_cache=True).past_key_values
    step_ids = torch.tensor([[p[context]] for p in prompts], device=device)

    def step():
        model(step_ids, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # drop the appended token, so every timed step appends to the same `context`-token cache
        if device.type == "cuda":
            torch.cuda.synchronize()

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
    parser.add_argument("--no-native-decode", action="store_true", help="kvstrata's --no-native-decode")
    parser.add_argument("--no-paged-kernel", action="store_true",
                        help="kvstrata's --no-paged-kernel: every format's torch path, without the compiled (CPU) or "
                             "Triton (GPU) kernels")
    parser.add_argument("--kv-offload", default="none", help="kvstrata's --kv-offload (default: none)")
    parser.add_argument("--no-transformers", action="store_true", help="profile kvstrata alone")
    parser.add_argument("--timed-steps", type=int, default=STEPS,
                        help=f"kvstrata's step_ms is the median of this many steps (default {STEPS}), timed before "
                             f"the {STEPS} profiled ones: more for a steadier figure on a noisy machine")
    parser.add_argument("--device", default="cpu", choices=DEVICES)
    parser.add_argument("--kv-format", default="fp32", help="kvstrata's --kv-format; several, comma-separated, "
                                                             "are profiled one after another")
    args = parser.parse_args()
    if args.timed_steps < 1:
        parser.error(f"--timed-steps {args.timed_steps}: at least 1")
    base = EngineConfig(enable_prefix_caching=False, weights=args.weights, compile=args.compile,
                        native_decode=not args.no_native_decode, kv_offload=args.kv_offload, device=args.device,
                        paged_kernel=not args.no_paged_kernel)
    loaded, steps = None, []
    for kv_format in args.kv_format.split(","):
        engine = LLMEngine(dataclasses.replace(base, kv_format=kv_format), loaded=loaded)  # the weights load once
        loaded = engine.loaded
        prompts = prompts_from_text(engine.tokenizer, args.batch, args.context + 1)
        steps.append(kvstrata_step(engine, prompts, args.context, args.timed_steps))
    report = {"benchmark": "profile_decode", "machine": machine_info(), "model": engine.loaded.name,
              "workload": vars(args), "kvstrata": steps[0] if len(steps) == 1 else steps}
    if not args.no_transformers:
        report["transformers"] = transformers_step(engine, prompts, args.context)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
