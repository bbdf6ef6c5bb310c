"""What a smaller KV cache buys at a fixed memory budget: tokens each format's cache holds, and offline
throughput when the budget caps the batch (papers/oaken.md §1, §5 Fig. 11, §7.5).

    .venv/bin/python -m benchmarks.oaken_capacity > benchmarks/results/oaken_capacity.json

Capacity: for every format, the engine's blocks x block size at `--budget` (KIVI also reserves its
full-precision window for `--max-num-seqs` sequences out of the budget). Throughput: at `--throughput-budget`,
`--requests` requests with greedy `--output-len`-token outputs and prompts sized so the fp32 cache holds only
`--fp32-batch` of them at once, all arriving at time 0, through kvstrata.bench.throughput.run_kvstrata
(sarathi scheduler); output tokens/s per format and the ratio to fp32. During each run the cache's store / load,
the formats' encode / decode and the attention math are timed by wrappers (benchmarks/oaken_call_timer.py), so
the report says how much of the run went to dequantization; the few microseconds a wrapper adds per call are
included, as is run_kvstrata's 2-token warm-up request. With `--both-orders` every format runs twice, in the listed
order and then in the reverse order, and its rate is the mean of its two runs: this machine's speed drifts during a
command, and a drift that is steady over the command then weighs on every format alike.
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


def capacity(base: EngineConfig, loaded, name: str) -> dict:
    engine, note = build_engine(base, loaded, kv_format=name)
    if engine is None:
        return {"format": name, "note": note}
    layout = engine_storage_layout(engine, getattr(torch, base.dtype), name)
    blocks = engine.kv_manager.pool.num_blocks
    row = {"format": name, "blocks": blocks, "tokens": blocks * base.block_size,
           "bytes_per_token": sig(layout.bytes_per_token), "reserved_bytes": getattr(layout, "reserved_bytes", 0)}
    del engine
    return row


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
    held = engine.kv_manager.pool.num_blocks * base.block_size
    del engine
    config = dataclasses.replace(base, kv_format=name)
    start = time.perf_counter()
    with CallTimer() as timer:
        figures = run_kvstrata(config, loaded, requests)
    wall = time.perf_counter() - start
    print(f"{name}: {figures['decode_tokens_per_s']} output tokens/s ({wall:.0f} s)", file=sys.stderr, flush=True)
    # On a GPU the wrapped calls return before their kernels finish, so only the wall time means something.
    breakdown = timer.report(wall) if base.device == "cpu" else {}
    return {"format": name, "tokens_held": held,
            "requests_fitting_at_once": min(base.max_num_seqs, len(requests), held // request_tokens),
            "output_tokens_per_s": figures["decode_tokens_per_s"], **figures,
            "time_breakdown": {"wall_s_incl_warmup": round(wall, 3), **breakdown}}


def mean_of_runs(listed: dict, reverse: dict) -> dict:
    """One format's two runs (listed order, reverse order): the mean rate, beside both runs' rows."""
    if "output_tokens_per_s" not in listed:
        return listed
    rates = [listed["output_tokens_per_s"], reverse["output_tokens_per_s"]]
    return {"format": listed["format"], "tokens_held": listed["tokens_held"],
            "requests_fitting_at_once": listed["requests_fitting_at_once"],
            "output_tokens_per_s": sig(sum(rates) / 2), "output_tokens_per_s_runs": rates,
            "runs": {"listed_order": listed, "reverse_order": reverse}}


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
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--both-orders", action="store_true",
                        help="run the throughput formats in the listed order, then in reverse; report each format's mean")
    args = parser.parse_args()
    formats = parse_formats(args.formats)

    # max_model_len only sets the least a cache must hold to be built at all
    base = EngineConfig(threads=args.threads, kv_cache_memory=args.budget, max_model_len=1024,
                        max_num_seqs=args.max_num_seqs, device=args.device)
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
        if args.both_orders:
            listed = [run(name) for name in formats]
            reverse = [run(name) for name in reversed(formats)][::-1]
            rows = [mean_of_runs(a, b) for a, b in zip(listed, reverse)]
        else:
            rows = [run(name) for name in formats]
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
