"""`kvstrata bench ...`: performance benchmarks."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvstrata.bench.serve import add_bench_serve_arguments
from kvstrata.cli.engine_args import add_engine_arguments
from kvstrata.data import EMMA


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print exactly one JSON document on stdout")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG plot here")
    parser.add_argument("--text", type=Path, default=EMMA, help="UTF-8 text the prompts are cut from")


def add_bench_commands(commands) -> None:
    bench = commands.add_parser("bench", help="performance benchmarks").add_subparsers(dest="bench", required=True)
    serve = bench.add_parser(
        "serve", help="load generator against a running server",
        description="Open-loop (Poisson arrivals at --request-rate) or closed-loop (--concurrency clients) "
                    "streaming load against a running kvstrata (or any OpenAI-compatible) server.",
    )
    add_bench_serve_arguments(serve)

    roofline = bench.add_parser(
        "roofline", help="the engine's decode and prefill against this machine's bandwidth and GEMM limits",
        description="Measures fp32 GEMM GFLOP/s and memory read bandwidth, derives the model's limits, and reports "
                    "`decode_fraction` (limit / measured batch-1 decode step) and `prefill_fraction` (measured "
                    "prefill tokens/s / GEMM limit), plus the same for --concurrent requests run together.",
    )
    roofline.add_argument("--prompt-len", type=int, default=1024, help="prefill prompt length (default: 1024)")
    roofline.add_argument("--decode-context", type=int, default=128, help="context of the decode steps (default: 128)")
    roofline.add_argument("--decode-steps", type=int, default=32, help="decode steps timed (default: 32)")
    roofline.add_argument("--concurrent", type=int, default=32, help="requests run together; 0 skips (default: 32)")
    roofline.add_argument("--concurrent-prompt-len", type=int, default=256)
    roofline.add_argument("--concurrent-output-len", type=int, default=128)
    _add_output_flags(roofline)
    add_engine_arguments(roofline)

    throughput = bench.add_parser(
        "throughput", help="offline workload: each scheduler against transformers generate",
        description="N requests arrive at once (prompts cut from --text, greedy, fixed seed). kvstrata runs them "
                    "under each of --schedulers, Hugging Face transformers with generate in left-padded static "
                    "batches of --hf-batch-size on the same weights. Reports tokens/s, TTFT / TPOT / end-to-end "
                    "percentiles, peak memory, and the ratios (`speedup_vs_transformers`, sarathi vs the others).",
    )
    throughput.add_argument("--requests", type=int, default=32, help="number of requests (default: 32)")
    throughput.add_argument("--prompt-len", default="256", help="N or uniform:LOW:HIGH tokens (default: 256)")
    throughput.add_argument("--output-len", default="128", help="N or uniform:LOW:HIGH tokens (default: 128)")
    throughput.add_argument("--schedulers", default="sarathi,prefill-first,static", help="comma-separated")
    throughput.add_argument("--hf-batch-size", type=int, default=None, help="transformers batch (default: all)")
    throughput.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    throughput.add_argument("--seed", type=int, default=0)
    _add_output_flags(throughput)
    add_engine_arguments(throughput)


def run_bench(args: argparse.Namespace) -> None:
    from kvstrata.bench.run import run_roofline, run_throughput
    from kvstrata.bench.serve import run_bench_serve

    {"serve": run_bench_serve, "roofline": run_roofline, "throughput": run_throughput}[args.bench](args)
