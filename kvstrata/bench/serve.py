"""`kvstrata bench serve`: streaming load against a running OpenAI-compatible server.

Open loop: requests arrive as a Poisson process at --request-rate (inf = all at once), optionally
capped at --concurrency in flight. Closed loop: --concurrency clients, each sending its next
request when the previous one ends. Metric names follow `vllm bench serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.bench.report import emit, machine_info
from kvstrata.bench.stats import summarize
from kvstrata.bench.workload import read_text
from kvstrata.data import EMMA
from kvstrata.errors import KvstrataError

CHARS_PER_TOKEN = 4  # rough; exact counts come back in each response's usage


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    parser.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send (closed loop: in all)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="open loop: mean requests per second, Poisson arrivals (default: inf, all at once)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="closed loop with this many clients, or a cap on requests in flight with a rate")
    parser.add_argument("--duration", type=float, default=None,
                        help="closed loop: keep sending for this many seconds instead of --num-prompts requests")
    parser.add_argument("--prompt-len", type=int, default=256, help="approximate prompt tokens (default: 256)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens to generate per request (default: 128)")
    parser.add_argument("--shared-prefixes", type=int, default=0,
                        help="draw every prompt's start from this many shared passages (documents asked several "
                             "questions): prompt = one of them + a passage of --prompt-len tokens (default: 0, none)")
    parser.add_argument("--shared-prefix-len", type=int, default=1024,
                        help="approximate tokens of each shared passage (default: 1024)")
    parser.add_argument("--text", type=Path, default=EMMA, help="UTF-8 text the prompts are cut from")
    parser.add_argument("--goodput", default=None,
                        help="latency objectives in ms for goodput, e.g. ttft:2000,tpot:300,e2el:60000")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before one request counts as failed")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON document on stdout")
    parser.add_argument("--plot", type=Path, default=None, help="write latency distributions to this PNG")
    parser.add_argument("--result-file", type=Path, default=None, help="also write the JSON here")


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def wait_healthy(base_url: str, seconds: float = 120) -> None:
    """Block until the server at `base_url` answers GET /health with 200."""
    import httpx

    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if httpx.get(base_url.rstrip("/") + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise KvstrataError(f"no healthy server at {base_url} after {seconds:.0f} s")


def make_prompts(text: str, count: int, prompt_len: int, seed: int, shared_prefixes: int = 0,
                 shared_prefix_len: int = 0) -> list[str]:
    """`count` passages of about `prompt_len` tokens from random places in `text`; with `shared_prefixes`,
    each comes after one of that many shared passages of about `shared_prefix_len` tokens, drawn at random."""
    rng = random.Random(seed)
    passages = _passages(text, count, prompt_len, rng)
    if not shared_prefixes:
        return passages
    documents = _passages(text, shared_prefixes, shared_prefix_len, rng)
    return [f"{rng.choice(documents)}\n\n{passage}" for passage in passages]


def _passages(text: str, count: int, tokens: int, rng: random.Random) -> list[str]:
    width = tokens * CHARS_PER_TOKEN
    if len(text) < 2 * width:
        raise KvstrataError(f"the text has {len(text)} characters, too few for passages of {tokens} tokens")
    return [text[start : start + width] for start in (rng.randrange(len(text) - width) for _ in range(count))]


def scrape_cache_counters(base_url: str) -> dict[str, float]:
    """The server's prefix-cache and KV-store token counters (a cluster's totals, not its per-replica
    series); empty for a server that has none."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        page = httpx.get(base_url.rstrip("/") + "/metrics", timeout=30).text
        families = list(text_string_to_metric_families(page))
    except (httpx.HTTPError, ValueError):
        return {}
    counters = {}
    for family in families:
        for sample in family.samples:
            if "replica" in sample.labels:
                continue
            if sample.name in ("kvstrata:prefix_cache_queries_total", "kvstrata:prefix_cache_hits_total"):
                counters[sample.name.split(":")[1].removesuffix("_total")] = sample.value
            elif sample.name == "kvstrata:kv_store_hit_tokens_total":
                counters[f"kv_store_hit_tokens_{sample.labels['tier']}"] = sample.value
    return counters


def cache_report(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the run itself did to the caches: differences of the counters scraped around it (nothing
    unless both scrapes found them; a replica restarted during the run resets its share)."""
    if not before or not after:
        return {}
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    queried = delta.get("prefix_cache_queries", 0.0)
    report = {"prefix_cache_queried_tokens": int(queried),
              "prefix_cache_hit_rate": round(delta.get("prefix_cache_hits", 0.0) / queried, 4) if queried else None}
    report.update({name: int(value) for name, value in delta.items() if name.startswith("kv_store_hit_tokens_")})
    return report


def parse_goodput(spec: str | None) -> dict[str, float]:
    if not spec:
        return {}
    objectives = {}
    for part in spec.split(","):
        name, _, value = part.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise KvstrataError(f"goodput objective {part!r} is not one of ttft:MS, tpot:MS, e2el:MS")
        objectives[name] = float(value) / 1000
    return objectives


async def _one_request(client, url: str, body: dict, chat: bool, timeout: float) -> RequestResult:
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text:
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "the stream carried no usage or no tokens"
    except Exception as exc:  # noqa: BLE001 - any network error or timeout counts as a failed request
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _run_load(args, model: str, prompts: list[str], progress) -> tuple[list[RequestResult], float]:
    import httpx

    chat = args.endpoint.endswith("chat/completions")
    url = args.base_url.rstrip("/") + args.endpoint

    def body(prompt: str) -> dict:
        request = {"model": model, "max_tokens": args.output_len, "stream": True, "ignore_eos": True,
                   "temperature": 0.0, "stream_options": {"include_usage": True}}
        if chat:
            return {**request, "messages": [{"role": "user", "content": prompt}]}
        return {**request, "prompt": prompt}

    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=args.concurrency or len(prompts) or 1)
    async with httpx.AsyncClient(limits=limits, timeout=args.timeout) as client:
        gate = asyncio.Semaphore(args.concurrency) if args.concurrency else None

        async def send(prompt: str) -> None:
            if gate is None:
                results.append(await _one_request(client, url, body(prompt), chat, args.timeout))
            else:
                async with gate:
                    results.append(await _one_request(client, url, body(prompt), chat, args.timeout))
            progress.update(1)

        start = time.perf_counter()
        if args.duration is not None:  # closed loop for a fixed time
            async def client_loop(offset: int) -> None:
                i = offset
                while time.perf_counter() - start < args.duration:
                    await send(prompts[i % len(prompts)])
                    i += args.concurrency
            await asyncio.gather(*(client_loop(c) for c in range(args.concurrency)))
        else:
            rng = random.Random(args.seed)
            tasks = []
            for prompt in prompts:
                tasks.append(asyncio.create_task(send(prompt)))
                if args.request_rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(args.request_rate))
            await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize_results(results: list[RequestResult], duration: float, goodput: dict[str, float]) -> dict:
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)

    def meets_objectives(r: RequestResult) -> bool:
        measured = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2e}
        return all(measured[name] <= limit for name, limit in goodput.items())

    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration": round(duration, 3),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": round(len(done) / duration, 4),
        "output_throughput": round(output_tokens / duration, 2),
        "total_token_throughput": round((input_tokens + output_tokens) / duration, 2),
    }
    if goodput:
        summary["request_goodput"] = round(sum(map(meets_objectives, done)) / duration, 4)
    summary.update(summarize([r.ttft for r in done], "ttft_ms", 1000))
    summary.update(summarize([r.tpot for r in done if r.tpot is not None], "tpot_ms", 1000))
    summary.update(summarize([gap for r in done for gap in r.itl], "itl_ms", 1000))
    summary.update(summarize([r.e2e for r in done], "e2el_ms", 1000))
    return summary


def plot_latencies(results: list[RequestResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.ok]
    series = {
        "TTFT (ms)": [r.ttft * 1000 for r in done],
        "TPOT (ms)": [r.tpot * 1000 for r in done if r.tpot is not None],
        "ITL (ms)": [g * 1000 for r in done for g in r.itl],
        "end-to-end (ms)": [r.e2e * 1000 for r in done],
    }
    figure, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (label, values) in zip(axes, series.items()):
        ax.hist(values, bins=30, color="#3a6ea5")
        ax.set_xlabel(label)
        ax.set_ylabel("count")
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def benchmark_server(args: argparse.Namespace) -> tuple[dict, list[RequestResult]]:
    """Run the load `args` describe; returns the report and every request's result."""
    import httpx
    from tqdm import tqdm

    if args.duration is not None and not args.concurrency:
        raise KvstrataError("--duration runs a closed loop and needs --concurrency N")
    goodput = parse_goodput(args.goodput)
    try:
        model = args.model or httpx.get(args.base_url.rstrip("/") + "/v1/models", timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise KvstrataError(f"cannot reach a server at {args.base_url}: {exc}") from exc
    count = args.num_prompts if args.duration is None else max(args.num_prompts, args.concurrency)
    if args.shared_prefixes < 0 or args.shared_prefix_len < 1:
        raise KvstrataError(f"--shared-prefixes must be at least 0 and --shared-prefix-len at least 1, got "
                            f"{args.shared_prefixes} and {args.shared_prefix_len}")
    prompts = make_prompts(read_text(args.text), count, args.prompt_len, args.seed, args.shared_prefixes,
                           args.shared_prefix_len)
    counters = scrape_cache_counters(args.base_url)
    with tqdm(total=None if args.duration else len(prompts), desc="requests") as progress:  # on stderr
        results, duration = asyncio.run(_run_load(args, model, prompts, progress))
    report = {
        "benchmark": "serve",
        "machine": machine_info(),  # the load generator's machine; the server may run elsewhere
        "base_url": args.base_url,
        "model": model,
        "workload": {
            "endpoint": args.endpoint, "num_prompts": len(results), "request_rate": str(args.request_rate),
            "concurrency": args.concurrency, "duration_s": args.duration, "prompt_len": args.prompt_len,
            "shared_prefixes": args.shared_prefixes, "shared_prefix_len": args.shared_prefix_len,
            "output_len": args.output_len, "text": str(args.text), "seed": args.seed, "goodput_ms":
            {k: v * 1000 for k, v in goodput.items()},
        },
        **summarize_results(results, duration, goodput),
        **cache_report(counters, scrape_cache_counters(args.base_url)),
    }
    return report, results


def run_bench_serve(args: argparse.Namespace) -> None:
    report, results = benchmark_server(args)
    model = report["model"]
    if args.plot:
        plot_latencies(results, args.plot, f"{model}: {len(results)} requests, rate {args.request_rate}")
    if args.result_file:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        args.result_file.write_text(json.dumps(report, indent=2))
    if args.json:
        emit(report, as_json=True)
    else:
        emit({k: v for k, v in report.items() if k != "workload"}, as_json=False)
