"""The KV store under load and faults: `kvstrata serve` with a disk and a Redis tier, 32 concurrent clients,
while Redis is killed and restarted, the disk tier's filesystem fills up, and stored objects are corrupted on
purpose. Every reply is compared with greedy output computed without any store (docs/BENCHMARKS.md, "KV store").

    .venv/bin/python -m benchmarks.kv_store_faults > benchmarks/results/kv_store_faults.json

Needs root: the disk tier lives on a small tmpfs mounted here, so that it really runs out of space.

Weights are float32 by default (`--weights`): outputs are compared token for token, and the default int4
kernels take activations in bfloat16, whose rounding can change a greedy token with the requests that share a
step, with or without a store. `--no-store` serves the same workload without a store (the faults still hit
Redis), the control that shows how many outputs differ for that reason alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import redis

from benchmarks.kv_store_ttft import QUESTIONS, TEXTS
from kvstrata.bench.redis_server import RedisServer, free_port
from kvstrata.bench.report import machine_info
from kvstrata.bench.serve import wait_healthy
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.kv.store.redis_tier import KEY_PREFIX
from kvstrata.llm import LLM

MAX_TOKENS = 16


def workload(llm: LLM, passages: int, requests: int, seed: int) -> list[str]:
    """`requests` prompts: passages of 500-900 tokens with a question, each passage asked several times."""
    rng = random.Random(seed)
    texts = [TEXTS[name].read_text(encoding="utf-8") for name in TEXTS]
    bodies = []
    for index in range(passages):
        text = texts[index % len(texts)]
        start = rng.randrange(0, len(text) - 8000)
        ids = llm.engine.tokenize(text[start : start + 8000])[: rng.randrange(500, 901)]
        bodies.append(llm.tokenizer.decode(ids))
    prompts = [bodies[rng.randrange(passages)] + rng.choice(QUESTIONS) for _ in range(requests)]
    return prompts


def corrupt_everything(disk_dir: Path, redis_url: str) -> int:
    """Flip a byte in every stored chunk file and overwrite one object of every Redis chunk."""
    count = 0
    for path in disk_dir.glob("*.kvc"):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        count += 1
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=KEY_PREFIX + "*"):
        client.hset(key, "k.0", b"not a kvstrata object")
        count += 1
    return count


async def run_clients(base_url: str, prompts: list[str], clients: int, progress: list[int]) -> list[dict]:
    queue = list(enumerate(prompts))
    results: list[dict] = [None] * len(prompts)

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            index, prompt = queue.pop(0)
            reply = await http.post(f"{base_url}/v1/completions", json={
                "model": "kvstrata", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
            results[index] = {"status": reply.status_code, "body": reply.json()}
            progress[0] += 1

    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return results


def faults(progress: list[int], total: int, server: RedisServer, disk_dir: Path, log: list[dict]) -> None:
    """Kill Redis at 20% of the replies, restart it at 40%, corrupt every stored object at 60%."""
    start = time.perf_counter()
    plan = [(0.2, "kill redis"), (0.4, "restart redis"), (0.6, "corrupt every stored object")]
    for share, action in plan:
        while progress[0] < share * total:
            time.sleep(0.05)
        if action == "kill redis":
            server.stop()
        elif action == "restart redis":
            server.start()
        else:
            action += f" ({corrupt_everything(disk_dir, server.url)} chunks)"
        log.append({"at_reply": progress[0], "seconds": round(time.perf_counter() - start, 1), "fault": action})


def store_metrics(base_url: str) -> dict:
    text = httpx.get(f"{base_url}/metrics").text
    found = re.findall(r'^kvstrata:kv_store_(\w+)_total\{[^}]*?(?:tier="(\w+)")?\} (\S+)$', text, re.MULTILINE)
    return {f"{name}[{tier}]" if tier else name: float(value) for name, tier, value in found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--passages", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tmpfs", default="48M", help="size of the disk tier's filesystem (it fills up)")
    parser.add_argument("--weights", default="fp32", help="the engines' --weights (see above)")
    parser.add_argument("--no-store", action="store_true", help="serve without a store: the control")
    args = parser.parse_args()
    llm = LLM(threads=2, weights=args.weights)
    prompts = workload(llm, args.passages, args.requests, args.seed)
    started = time.perf_counter()
    reference = {p: o.text for p, o in zip(prompts, llm.generate(prompts, SamplingParams(temperature=0,
                                                                                          max_tokens=MAX_TOKENS)))}
    reference_seconds = time.perf_counter() - started
    del llm
    with tempfile.TemporaryDirectory() as scratch:
        disk_dir = Path(scratch) / "disk"
        disk_dir.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.tmpfs}", "tmpfs", str(disk_dir)], check=True)
        server = RedisServer(Path(scratch)).start()
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        spec = f"disk:{disk_dir}:1GiB,{server.url}"  # the budget exceeds the filesystem: writes hit ENOSPC
        store = [] if args.no_store else ["--kv-store", spec, "--kv-store-timeout-ms", "500"]
        # 100 MiB of device KV holds about 2,300 tokens: three passages; the rest is found below or recomputed.
        process = subprocess.Popen([sys.executable, "-m", "kvstrata.cli.main", "serve", "--port", str(port),
                                    "--threads", "2", "--kv-cache-memory", "100MiB", "--max-model-len", "1024",
                                    "--weights", args.weights, *store, "--served-model-name", "kvstrata"],
                                   stdout=sys.stderr)  # its access log must not mix with the JSON
        try:
            wait_healthy(base_url, 300)
            progress, fault_log = [0], []
            injector = threading.Thread(target=faults, args=(progress, len(prompts), server, disk_dir, fault_log))
            injector.start()
            started = time.perf_counter()
            results = asyncio.run(run_clients(base_url, prompts, args.clients, progress))
            seconds = time.perf_counter() - started
            injector.join()
            metrics = store_metrics(base_url)
            disk_use = subprocess.run(["df", "-B1", str(disk_dir)], capture_output=True, text=True, check=False).stdout
        finally:
            process.terminate()
            process.wait(timeout=60)
            server.stop()
            subprocess.run(["umount", str(disk_dir)], check=False)
    failed = [r for r in results if r["status"] != 200]
    texts = [r["body"]["choices"][0]["text"] if r["status"] == 200 else None for r in results]
    mismatched = [i for i, (p, t) in enumerate(zip(prompts, texts)) if t is not None and t != reference[p]]
    report = {
        "machine": machine_info(), "clients": args.clients, "requests": len(prompts), "distinct_prompts":
        len(set(prompts)), "max_tokens": MAX_TOKENS, "kv_store": None if args.no_store else spec.replace(scratch, "<tmp>"), "weights": args.weights,
        "disk_filesystem": f"tmpfs {args.tmpfs}", "faults": fault_log, "failed_requests": len(failed),
        "outputs_differing_from_no_store": len(mismatched), "seconds": seconds,
        "reference_seconds_offline": reference_seconds, "store_metrics": metrics, "df_at_end": disk_use,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
