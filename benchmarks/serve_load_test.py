"""Load test of `kvstrata serve` on the default model: closed-loop streaming clients for a fixed time.

    .venv/bin/python -m benchmarks.serve_load_test --clients 64 --seconds 120

Starts the server as a subprocess, samples its resident memory, runs the clients (the
`kvstrata bench serve` machinery), checks the server's /metrics against what the clients
counted, then stops the server with SIGTERM and checks it exits 0. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from kvstrata.bench.report import machine_info
from kvstrata.bench.serve import add_bench_serve_arguments, benchmark_server, plot_latencies, wait_healthy


def metric_totals(url: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("kvstrata:") and not line.startswith("#"):
            name = line.split("{", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--server-args", default="", help="extra flags for kvstrata serve")
    parser.add_argument("--plot", type=Path, default=None)
    own, rest = parser.parse_known_args()
    bench_parser = argparse.ArgumentParser()
    add_bench_serve_arguments(bench_parser)
    url = f"http://127.0.0.1:{own.port}"
    bench_args = bench_parser.parse_args(
        ["--base-url", url, "--concurrency", str(own.clients), "--duration", str(own.seconds), "--json", *rest]
    )

    server = subprocess.Popen(
        [sys.executable, "-m", "kvstrata.cli.main", "serve", "--port", str(own.port), *own.server_args.split()],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    peak_rss, stop_sampling = [0], threading.Event()

    def sample_rss() -> None:
        process = psutil.Process(server.pid)
        while not stop_sampling.is_set():
            peak_rss[0] = max(peak_rss[0], process.memory_info().rss)
            time.sleep(0.25)

    try:
        wait_healthy(url, 180)
        rss_idle = psutil.Process(server.pid).memory_info().rss
        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        report, results = benchmark_server(bench_args)
        time.sleep(1.0)  # let the engine loop publish its last step
        metrics = metric_totals(url)
        stop_sampling.set()
        sampler.join()
        server.send_signal(signal.SIGTERM)
        exit_code = server.wait(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()

    finished = metrics.get("kvstrata:request_success_total", 0.0)
    checks = {
        "zero_errors": report["failed"] == 0,
        "metrics_requests_match_clients": finished == report["completed"],
        "metrics_generation_tokens_match_clients":
            metrics.get("kvstrata:generation_tokens_total") == report["total_output_tokens"],
        "metrics_prompt_tokens_match_clients":
            metrics.get("kvstrata:prompt_tokens_total") == report["total_input_tokens"],
        "idle_after_load": metrics.get("kvstrata:num_requests_running") == 0
            and metrics.get("kvstrata:kv_cache_usage_perc") == 0,
        "sigterm_exit_code_0": exit_code == 0,
    }
    print(json.dumps({
        "benchmark": "serve_load_test",
        "machine": machine_info(),
        "clients": own.clients,
        "seconds": own.seconds,
        "server_rss_idle_mib": round(rss_idle / 2**20, 1),
        "server_rss_peak_mib": round(peak_rss[0] / 2**20, 1),
        "metrics": {k: v for k, v in metrics.items() if not k.endswith(("_bucket", "_sum", "_count"))},
        "checks": checks,
        "all_checks_pass": all(checks.values()),
        "load": report,
    }, indent=2), flush=True)
    if own.plot:
        plot_latencies(results, own.plot, f"{own.clients} streaming clients for {own.seconds:.0f} s")


if __name__ == "__main__":
    main()
