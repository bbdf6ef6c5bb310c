"""What a smaller KV cache buys at a fixed memory budget: tokens each format's cache holds, and offline
throughput when the budget caps the batch (papers/oaken.md §1, §5 Fig. 11, §7.5).

    .venv/bin/python -m benchmarks.oaken_capacity > benchmarks/results/oaken_capacity.json

Capacity: for every format, the engine's blocks x block size at `--budget` (KIVI's full-precision window is
made of the same blocks, lent to it as sequences need them: `block_group` is how many a window slot takes). Throughput: at `--throughput-budget`,
`--requests` requests with greedy `--output-len`-token outputs and prompts sized so the fp32 cache holds only
`--fp32-batch` of them at once, all arriving at time 0, through kvstrata.bench.throughput.run_kvstrata
(sarathi scheduler); output tokens/s per format and the ratio to fp32. `requests_fitting_at_once` is the budget's
arithmetic (requests of full length it holds, each with its window under KIVI); each run also reports how many sequences the scheduler ran at
once, `most_sequences_in_a_step` (it admits on what a request holds now), and how often it took one out to make
room, `preemptions` (that sequence's work is done again). During each run the cache's store / load,
the formats' encode / decode and the attention math are timed by wrappers (benchmarks/oaken_call_timer.py), so
the report says how much of the run went to dequantization; the few microseconds a wrapper adds per call are
included, as is run_kvstrata's 2-token warm-up request. With `--both-orders` every format runs twice, in the listed
order and then in the reverse order, and its rate is the mean of its two runs: this machine's speed drifts during a
command, and a drift that is steady over the command then weighs on every format alike. With `--paired` fp32 runs
before and after every other format's run (fp32, a, fp32, b, fp32, ...; with `--both-orders`, then the formats again
in reverse) and each run's ratio is to the mean of the two fp32 runs beside it: the speed of this machine can move
by a fifth within one command, and the runs beside a format's are a minute from it, not several.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch

from benchmarks.oaken_call_timer import CallTimer
from benchmarks.oaken_common import FORMATS, build_engine, parse_formats
from kvstrata.bench.report import machine_info, sig
from kvstrata.bench.throughput import run_kvstrata
from kvstrata.bench.workload import parse_length, sample_requests
from kvstrata.config import DEVICES, EngineConfig, parse_memory_size
from kvstrata.data import EMMA
from kvstrata.engine.kv_setup import engine_storage_layout
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.kv.kivi_cache import KiviPagedKVCache


def capacity(base: EngineConfig, loaded, name: str) -> dict:
    engine, note = build_engine(base, loaded, kv_format=name)
    if engine is None:
        return {"format": name, "note": note}
    layout = engine_storage_layout(engine, getattr(torch, base.dtype), name)
    blocks = engine.kv_manager.pool.num_blocks
    row = {"format": name, "blocks": blocks, "tokens": blocks * base.block_size,
           "bytes_per_token": sig(layout.bytes_per_token), "block_group": layout.block_group}
    del engine
    return row


def window_blocks(storage) -> tuple[int, int]:
    """KIVI's float16 window in blocks of the pool: a request's most, and what a step adds; (0, 0) elsewhere."""
    if not isinstance(storage, KiviPagedKVCache):
        return 0, 0
    return storage.slots_per_sequence * storage.group_size, storage.slots_a_step_adds * storage.group_size


def with_ratios(rows: list[dict], key: str) -> list[dict]:
    fp32 = next((r[key] for r in rows if r["format"] == "fp32" and key in r), None)
    for r in rows:
        if fp32 and key in r:
            r[f"{key}_ratio_to_fp32"] = sig(r[key] / fp32)
    return rows


def throughput(base: EngineConfig, loaded, name: str, requests, request_tokens: int) -> dict:
    engine, note = build_engine(base, loaded, kv_format=name)  # checks the configuration, and sizes the batch
    if engine is None:
        return {"format": name, "note": note}
    blocks, request_blocks = engine.kv_manager.pool.num_blocks, -(-request_tokens // base.block_size)
    window = window_blocks(engine.kv_cache)
    fitting = (blocks - window[1]) // (request_blocks + window[0])
    del engine
    config = dataclasses.replace(base, kv_format=name)
    start = time.perf_counter()
    with CallTimer() as timer:
        figures = run_kvstrata(config, loaded, requests)
    wall = time.perf_counter() - start
    print(f"{name}: {figures['decode_tokens_per_s']} output tokens/s ({wall:.0f} s)", file=sys.stderr, flush=True)
    # On a GPU the wrapped calls return before their kernels finish, so only the wall time means something.
    breakdown = timer.report(wall) if base.device == "cpu" else {}
    return {"format": name, "tokens_held": blocks * base.block_size,
            "requests_fitting_at_once": min(base.max_num_seqs, len(requests), fitting),
            "output_tokens_per_s": figures["decode_tokens_per_s"], **figures,
            "time_breakdown": {"wall_s_incl_warmup": round(wall, 3), **breakdown}}


def mean_of_runs(listed: dict, reverse: dict) -> dict:
    """One format's two runs (listed order, reverse order): the mean rate, beside both runs' rows."""
    if "output_tokens_per_s" not in listed:
        return listed
    return {**summary([listed, reverse]), "runs": {"listed_order": listed, "reverse_order": reverse}}


def paired(run, formats: list[str], passes: int) -> list[dict]:
    """`--paired`: every format but fp32 run between two fp32 runs, over `passes` passes (the second in reverse
    order); a format's ratio is the mean over its runs of its rate / the mean rate of the fp32 runs beside it."""
    others = [name for name in formats if name != "fp32"]
    fp32_runs = [run("fp32")]
    beside: dict[str, list[tuple[dict, float]]] = {name: [] for name in others}  # (its run, fp32's rate beside it)
    unbuilt: dict[str, dict] = {}  # formats this machine cannot build, with the reason
    for name in (name for p in range(passes) for name in (others if p % 2 == 0 else others[::-1])):
        if name in unbuilt:
            continue
        row = run(name)
        if "output_tokens_per_s" not in row:
            unbuilt[name] = row
            continue
        fp32_runs.append(run("fp32"))
        beside[name].append((row, mean_rate(fp32_runs[-2:])))
    rows = [{**summary(fp32_runs), "output_tokens_per_s_ratio_to_fp32": 1.0}]
    for name in others:
        if name in unbuilt:
            rows.append(unbuilt[name])
            continue
        ratios = [sig(row["output_tokens_per_s"] / fp32_rate) for row, fp32_rate in beside[name]]
        rows.append({**summary([row for row, _ in beside[name]]),
                     "fp32_beside_each_run": [sig(fp32_rate) for _, fp32_rate in beside[name]],
                     "output_tokens_per_s_ratio_to_fp32_beside_runs": ratios,
                     "output_tokens_per_s_ratio_to_fp32": sig(sum(ratios) / len(ratios))})
    return rows


def mean_rate(runs: list[dict]) -> float:
    return sum(r["output_tokens_per_s"] for r in runs) / len(runs)


def summary(runs: list[dict]) -> dict:
    """One format's runs: the mean rate, beside every run's rate and row."""
    first = runs[0]
    return {"format": first["format"], "tokens_held": first["tokens_held"],
            "requests_fitting_at_once": first["requests_fitting_at_once"], "output_tokens_per_s": sig(mean_rate(runs)),
            "output_tokens_per_s_runs": [r["output_tokens_per_s"] for r in runs], "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--budget", default="256MiB", help="KV memory of the capacity table")
    parser.add_argument("--throughput-budget", default="96MiB", help="KV memory of the throughput runs")
    parser.add_argument("--fp32-batch", type=int, default=2, help="requests the fp32 cache holds at once")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=DEVICES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--oaken-calibration", default=None,
                        help="Oaken's thresholds file (kvstrata calibrate oaken), e.g. for other group ratios "
                             "(default: the model's shipped one)")
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--both-orders", action="store_true",
                        help="run the throughput formats in the listed order, then in reverse; report each format's mean")
    parser.add_argument("--paired", action="store_true",
                        help="run fp32 before and after every other format; each ratio is to the fp32 runs beside it")
    args = parser.parse_args()
    formats = parse_formats(args.formats)

    # max_model_len only sets the least a cache must hold to be built at all
    base = EngineConfig(threads=args.threads, kv_cache_memory=args.budget, max_model_len=1024,
                        max_num_seqs=args.max_num_seqs, device=args.device, oaken_calibration=args.oaken_calibration)
    reference = LLMEngine(dataclasses.replace(base, kv_cache_memory="256MiB"))
    loaded = reference.loaded
    table = with_ratios([capacity(base, loaded, name) for name in formats], "tokens")
    report = {
        "benchmark": "oaken_capacity",
        "machine": machine_info(),
        "model": loaded.name,
        "capacity": {"budget_bytes": parse_memory_size(args.budget), "config": dataclasses.asdict(base),
                     "results": table},
    }
    if not args.no_throughput:
        # Requests sized so that the fp32 cache at the throughput budget holds `fp32_batch` of them at once.
        budget = parse_memory_size(args.throughput_budget)
        fp32_tokens = budget // round(engine_storage_layout(reference, torch.float32, "fp32").bytes_per_token)
        request_tokens = (fp32_tokens // args.fp32_batch) // base.block_size * base.block_size
        prompt_len = request_tokens - args.output_len
        run_base = dataclasses.replace(base, kv_cache_memory=budget, max_model_len=request_tokens)
        requests = sample_requests(reference.tokenizer, args.requests, parse_length(str(prompt_len), "prompt-len"),
                                   parse_length(str(args.output_len), "output-len"), EMMA, args.seed)
        del reference
        run = lambda name: throughput(run_base, loaded, name, requests, request_tokens)
        if args.paired:
            rows = paired(run, formats, 2 if args.both_orders else 1)
        elif args.both_orders:
            listed = [run(name) for name in formats]
            reverse = [run(name) for name in reversed(formats)][::-1]
            rows = [mean_of_runs(a, b) for a, b in zip(listed, reverse)]
        else:
            rows = [run(name) for name in formats]
        if not args.paired:
            rows = with_ratios(rows, "output_tokens_per_s")
        report["throughput"] = {
            "workload": {"requests": args.requests, "prompt_len": prompt_len, "output_len": args.output_len,
                         "budget_bytes": budget, "fp32_batch": args.fp32_batch, "text": EMMA.name, "seed": args.seed,
                         "scheduler": run_base.scheduler},
            "config": dataclasses.asdict(run_base),
            "results": rows,
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
