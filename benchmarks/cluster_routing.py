"""Replicated serving on this machine (`kvstrata serve --replicas 2`, in-process): the routing policies
against each other on a shared-prefix workload, with and without the shared Redis tier, and on a workload
without shared prefixes (docs/BENCHMARKS.md, "Replicas on Ray Serve").

    .venv/bin/python -m benchmarks.cluster_routing --part routing --out benchmarks/results/cluster_routing.json
    .venv/bin/python -m benchmarks.cluster_routing --part faults --out benchmarks/results/cluster_faults.json

(`--out` writes the JSON to a file: Ray's own messages also reach stdout. `--policies` and `--workloads` run a
subset: e.g. `--policies prefix,kv-aware --workloads shared`; `--fronts 2` puts two routers in front.)

Both replicas share this machine's cores (one thread each), so the figures are ratios between policies
measured in the same run, not a cluster's capacity. Each configuration gets a fresh deployment (empty
device caches) and an emptied Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvstrata.bench.redis_server import RedisServer, free_port
from kvstrata.bench.report import machine_info
from kvstrata.bench.serve import add_bench_serve_arguments, benchmark_server, make_prompts
from kvstrata.bench.workload import read_text
from kvstrata.cluster.frontend import REPLICA_HEADER
from kvstrata.cluster.launch import APP_NAME, deploy, undeploy
from kvstrata.cluster.routing import POLICIES
from kvstrata.config import EngineConfig
from kvstrata.data import EMMA
from kvstrata.server.options import ServerOptions

REPLICAS = 2
# Each replica's device pool holds about 6,000 tokens (46,080 bytes per token): room for half of the
# sixteen 512-token passages with their questions, not for all of them, so a replica that sees every
# passage evicts some before they are asked again.
ENGINE = {"kv_cache_memory": "270MiB", "max_model_len": 1024}
PORT = free_port()  # Serve's HTTP proxy keeps the port it started on for the whole Ray session
REPORTED = ("completed", "failed", "errors", "duration", "request_throughput", "output_throughput", "p50_ttft_ms",
            "p99_ttft_ms", "p50_e2el_ms", "prefix_cache_queried_tokens", "prefix_cache_hit_rate")


def serve_args(base_url: str, shared: bool, seed: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_serve_arguments(parser)
    flags = ["--base-url", base_url, "--num-prompts", "96", "--concurrency", "4", "--output-len", "16",
             "--seed", str(seed)]
    if shared:  # sixteen passages of 512 tokens, each asked six questions of 64 tokens on average
        flags += ["--shared-prefixes", "16", "--shared-prefix-len", "512", "--prompt-len", "64"]
    else:  # prompts as long, all distinct
        flags += ["--prompt-len", "576"]
    return parser.parse_args(flags)


def measure(policy: str, store: RedisServer | None, shared: bool, seed: int, fronts: int = 1) -> dict:
    config = EngineConfig(**ENGINE, kv_store=None if store is None else store.url)
    url = deploy(config, ServerOptions(), REPLICAS, policy, "127.0.0.1", PORT, fronts=fronts)
    try:
        report, _ = benchmark_server(serve_args(url, shared, seed))
    finally:
        undeploy(stop_ray=False)
        if store is not None:
            store.flush()
    row = {"routing": policy, "fronts": fronts, "store": "redis" if store else "none",
           "workload": "shared prefixes" if shared else "no shared prefixes"}
    row.update({key: report.get(key) for key in REPORTED})
    row.update({key: value for key, value in report.items() if key.startswith("kv_store_hit_tokens_")})
    return row


def ratios(rows: list[dict], policy: str) -> list[dict]:
    """`policy` against each other policy under the same workload and store."""
    out = []
    for mine in (r for r in rows if r["routing"] == policy):
        for other in rows:
            if other["routing"] == policy or (other["store"], other["workload"]) != (mine["store"], mine["workload"]):
                continue
            out.append({
                "workload": mine["workload"], "store": mine["store"], "against": other["routing"],
                "hit_rate": [mine["prefix_cache_hit_rate"], other["prefix_cache_hit_rate"]],
                "ttft_p50_ratio": round(other["p50_ttft_ms"] / mine["p50_ttft_ms"], 3),
                "throughput_ratio": round(mine["request_throughput"] / other["request_throughput"], 3),
            })
    return out


WORKLOADS = {"shared": (True, False), "shared-redis": (True, True), "distinct": (False, False)}  # (shared, Redis?)


def part_routing(store: RedisServer, seed: int, policies: list[str], workloads: list[str], fronts: int) -> dict:
    rows = []
    for workload in workloads:
        shared, redis = WORKLOADS[workload]
        for policy in policies:
            rows.append(measure(policy, store if redis else None, shared, seed, fronts))
            print(json.dumps(rows[-1]), file=sys.stderr)
    return {"rows": rows, **{f"{policy.replace('-', '_')}_routing_against": ratios(rows, policy)
                             for policy in ("prefix", "kv-aware") if policy in policies}}


# --- a replica killed under load -----------------------------------------------------------------------


def fault_prompts(count: int, seed: int) -> list[str]:
    return make_prompts(read_text(EMMA), count, 96, seed, shared_prefixes=12, shared_prefix_len=384)


async def closed_loop(url: str, prompts: list[str], clients: int, done: list) -> list[dict]:
    """Non-streaming requests from `clients` concurrent clients; each reply's text, status and replica."""
    replies: list[dict] = [{} for _ in prompts]
    queue = list(range(len(prompts)))

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            index = queue.pop(0)
            body = {"model": "m", "prompt": prompts[index], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            try:
                response = await client.post(url + "/v1/completions", json=body, timeout=600)
                replies[index] = {"status": response.status_code, "replica": response.headers.get(REPLICA_HEADER),
                                  "text": response.json()["choices"][0]["text"] if response.status_code == 200
                                  else response.text[:200]}
            except httpx.HTTPError as exc:
                replies[index] = {"status": None, "text": f"{type(exc).__name__}: {exc}"}
            done.append(time.perf_counter())

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    return replies


def kill_replica_when(url: str, done: list, after: int, events: dict) -> None:
    """Once `after` requests are done, SIGKILL replica 0's process, then note when the front stops sending
    it requests and when Ray Serve has it back."""
    from ray import serve

    while len(done) < after:
        time.sleep(0.05)
    identity = serve.get_deployment_handle("kvstrata-replica-0", APP_NAME).identity.remote().result()
    killed_at = time.perf_counter()
    os.kill(identity["pid"], signal.SIGKILL)
    events["killed_after_requests"] = len(done)
    while httpx.get(url + "/health", timeout=30).json()["replicas_up"] == REPLICAS:
        time.sleep(0.05)
    events["marked_down_s"] = round(time.perf_counter() - killed_at, 2)
    while httpx.get(url + "/health", timeout=30).json()["replicas_up"] < REPLICAS:
        time.sleep(0.2)
    events["back_up_s"] = round(time.perf_counter() - killed_at, 2)


def part_faults(store: RedisServer, seed: int, requests: int, clients: int) -> dict:
    prompts = fault_prompts(requests, seed)
    # fp32 weights: under the default int4 weights a request's greedy text depends on its batch (few rows
    # take the int4 kernel, many the dense one), so two fault-free runs already differ and the comparison
    # would say nothing about the fault.
    config = EngineConfig(**ENGINE, kv_store=store.url, weights="fp32")
    runs = {}
    for name in ("fault-free", "replica killed"):
        url = deploy(config, ServerOptions(), REPLICAS, "prefix", "127.0.0.1", PORT, model_name="m")
        done: list[float] = []
        events: dict = {}
        killer = None
        if name == "replica killed":
            killer = threading.Thread(target=kill_replica_when, args=(url, done, requests // 4, events))
            killer.start()
        start = time.perf_counter()
        replies = asyncio.run(closed_loop(url, prompts, clients, done))
        duration = time.perf_counter() - start
        if killer is not None:
            killer.join()
        retries = [line for line in httpx.get(url + "/metrics", timeout=30).text.splitlines()
                   if line.startswith("kvstrata:router_retries_total ")]
        undeploy(stop_ray=False)
        store.flush()
        runs[name] = {"replies": replies, "duration_s": round(duration, 2), "events": events,
                      "retries": float(retries[0].split()[1]) if retries else None}
    free, faulty = runs["fault-free"]["replies"], runs["replica killed"]["replies"]
    return {
        "requests": requests, "clients": clients, "max_tokens": 24, "weights": "fp32",
        "failed": {name: sum(r.get("status") != 200 for r in run["replies"]) for name, run in runs.items()},
        "outputs_differing_from_fault_free": sum(a.get("text") != b.get("text") for a, b in zip(free, faulty)),
        "answered_by": {name: {replica: sum(r.get("replica") == replica for r in run["replies"]) for replica in "01"}
                        for name, run in runs.items()},
        "retries": runs["replica killed"]["retries"],
        "events": runs["replica killed"]["events"],
        "duration_s": {name: run["duration_s"] for name, run in runs.items()},
        "errors": sorted({r["text"] for r in faulty if r.get("status") != 200})[:5],
    }


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["routing", "faults"], required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(POLICIES), help="routing: the policies to run, comma-separated")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"routing: the workloads to run them on, comma-separated among {', '.join(WORKLOADS)}")
    parser.add_argument("--fronts", type=int, default=1, help="routing: routers in front of the replicas (default: 1)")
    parser.add_argument("--requests", type=int, default=96, help="faults: requests in each run")
    parser.add_argument("--clients", type=int, default=32, help="faults: concurrent clients")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    for flag, given, allowed in (("--policies", args.policies, POLICIES), ("--workloads", args.workloads, WORKLOADS)):
        unknown = set(given.split(",")) - set(allowed)
        if unknown:
            parser.error(f"{flag}: {', '.join(sorted(unknown))} not among {', '.join(allowed)}")
    ray.init(include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as scratch:
        store = RedisServer(Path(scratch)).start()
        try:
            if args.part == "routing":
                figures = part_routing(store, args.seed, args.policies.split(","), args.workloads.split(","),
                                       args.fronts)
            else:
                figures = part_faults(store, args.seed, args.requests, args.clients)
        finally:
            store.stop()
            undeploy(stop_ray=True)
    report = {"benchmark": f"cluster_{args.part}", "machine": machine_info(), "replicas": REPLICAS,
              "engine": ENGINE, **figures}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
