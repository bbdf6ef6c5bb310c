"""What the host tier keeps under a prefix-reuse trace (`--kv-store-eviction lru|lfu|score`, issue 14; docs/
BENCHMARKS.md, "IMPRESS: tiers managed by importance").

    python -m benchmarks.impress_tiers > benchmarks/results/impress_tiers.json

A pool of `--prefixes` stored prefixes of `--prefix-tokens` tokens (one node: 16 chunks of 64 tokens), half from
Persuasion, half from the Python tutorial, all on a disk tier; a trace of `--requests` requests, each one prefix
(drawn by a Zipf law of exponent `--zipf`: a few prefixes are asked often, most rarely) followed by a 64-token
passage from elsewhere in its text and a question line. One engine per system serves the whole trace, with a
host tier of `--host-share` of the pool's bytes (the prefixes' K and V in float16) above the disk; before every
request its device pool forgets its cached prefixes and the disk files are dropped from the page cache, so each
prefix comes from host memory or from a cold disk. Every system serves the same trace, with an equal host budget.

Systems: recompute (no store), `full` and keys-only H2O loads with LRU and LFU, IMPRESS loads, and IMPRESS over
reordered nodes with LRU, LFU and the importance score (the paper's ablation: importance loading, + reordering,
+ score-based tiers). The reordered store comes from loading each prefix with `--warm-questions` other questions
by IMPRESS (the running importance), then one reordering pass. Per system: time to first token, the host tier's
hit ratio (object sets a load read from host memory, of all it read), the same weighted by each set's important
share, the bytes a load read from disk, the bytes read from disk in the background to copy chunks up, and the
chunks the host tier refused.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.impress_loading import QUESTION, QUESTION_TOKENS, TEXTS, drop_page_cache, reorder_after, store_prefix
from benchmarks.kv_store_ttft import first_token
from kvstrata.bench.report import machine_info
from kvstrata.bench.stats import summarize
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine

CHUNK_TOKENS = 64
SYSTEMS = {  # name: (prefix loading, eviction, reordered store)
    "full+lru": ("full", "lru", False),
    "full+lfu": ("full", "lfu", False),
    "h2o-keys+lru": ("h2o-keys", "lru", False),
    "h2o-keys+lfu": ("h2o-keys", "lfu", False),
    "impress+lru": ("impress", "lru", False),
    "impress+reorder+lru": ("impress", "lru", True),
    "impress+reorder+lfu": ("impress", "lfu", True),
    "impress+reorder+score": ("impress", "score", True),
}


def prefix_pool(engine: LLMEngine, prefixes: int, prefix_tokens: int, rng: random.Random):
    """(prefix tokens, the token ids of its text) per prefix, alternating between the texts."""
    texts = {name: engine.tokenize(path.read_text(encoding="utf-8")) for name, path in TEXTS.items()}
    pool = []
    for index in range(prefixes):
        ids = texts[list(texts)[index % len(texts)]]
        start = rng.randrange(0, len(ids) - prefix_tokens)
        pool.append((ids[start : start + prefix_tokens], ids))
    return pool


def question(prefix_and_text, rng: random.Random, line: list[int]) -> list[int]:
    prefix, ids = prefix_and_text
    at = rng.randrange(0, len(ids) - QUESTION_TOKENS)
    return prefix + ids[at : at + QUESTION_TOKENS] + line


def zipf_trace(prefixes: int, requests: int, exponent: float, rng: random.Random) -> list[int]:
    weights = [1 / (rank + 1) ** exponent for rank in range(prefixes)]
    return rng.choices(range(prefixes), weights=weights, k=requests)


def stored_pool(loaded, base: dict, directory: Path, prompts: list[list[int]]) -> int:
    """Store the prefix of each prompt (a prefix, a passage, a question line) on a disk tier at `directory`; the
    bytes stored there."""
    options = {**base, "kv_store": f"disk:{directory}:16GiB"}
    for prompt in prompts:
        store_prefix(loaded, options, prompt)
    return sum(path.stat().st_size for path in directory.glob("*.kvc"))


def serve_trace(loaded, options: dict, trace: list[list[int]], disk_dir: Path | None) -> dict:
    engine = LLMEngine(EngineConfig(**options), loaded=loaded)
    ttfts = []
    for prompt in trace:
        engine.reset_prefix_cache()
        if disk_dir is not None:
            drop_page_cache(disk_dir)
        ttfts.append(first_token(engine, prompt, 1).metrics.ttft)
        if engine.kv_store is not None:
            engine.kv_store.flush()  # copies up finish before the next request: every system sees the same order
    row = {**summarize(ttfts, "ttft_ms", scale=1000), "requests": len(trace)}
    if engine.kv_store is not None:
        host, disk = engine.kv_store.store.tiers
        hits, misses = host.stats.chunk_hits, host.stats.chunk_misses
        important = host.stats.important_hits + host.stats.important_misses
        row.update(host_hit_ratio=round(hits / max(hits + misses, 1), 4),
                   host_important_hit_ratio=round(host.stats.important_hits / max(important, 1e-9), 4),
                   object_sets_read=hits + misses,
                   host_bytes_read_per_request=round(host.stats.bytes_read / len(trace)),
                   disk_bytes_read_per_request=round(disk.stats.bytes_read / len(trace)),
                   disk_bytes_copied_up_per_request=round(disk.stats.bytes_promoted / len(trace)),
                   host_chunks_refused=host.stats.chunks_refused, host_chunks_evicted=host.stats.chunks_evicted,
                   host_bytes_held=host.usage().bytes)
        engine.kv_store.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", type=int, default=12)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--host-share", type=float, default=0.25, help="host tier budget / the pool's K and V bytes")
    parser.add_argument("--warm-questions", type=int, default=2)
    parser.add_argument("--ratio", type=float, default=0.25, help="--impress-ratio of the importance loads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default=",".join(["recompute", *SYSTEMS]))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    first = LLMEngine(EngineConfig(threads=2))
    loaded = first.loaded
    first_token(first, first.tokenize(QUESTION * 200), 2)  # warm-up: kernels and allocator, off the clock
    line = first.tokenize(QUESTION)
    pool = prefix_pool(first, args.prefixes, args.prefix_tokens, rng)
    asked = zipf_trace(args.prefixes, args.requests, args.zipf, rng)
    trace = [question(pool[p], rng, line) for p in asked]
    warm = [(p, question(pool[p], rng, line)) for p in range(args.prefixes) for _ in range(args.warm_questions)]
    base = {"threads": 2, "kv_store_format": "fp16", "kv_store_chunk_tokens": CHUNK_TOKENS, "impress_ratio": args.ratio,
            "impress_reorder_seconds": 0}
    report = {"machine": machine_info(), **{k: v for k, v in vars(args).items() if k != "systems"},
              "chunk_tokens": CHUNK_TOKENS, "requests_per_prefix": [asked.count(p) for p in range(len(pool))],
              "systems": {}}
    with tempfile.TemporaryDirectory() as scratch:
        # (probe keys, reordered) -> the disk directory every system of that kind starts from a copy of
        stores = {(False, False): Path(scratch) / "plain", (True, False): Path(scratch) / "probed"}
        firsts = [prompt for _, prompt in warm[:: args.warm_questions]]  # one prompt per prefix, to store it
        pool_bytes = stored_pool(loaded, base, stores[False, False], firsts)
        stored_pool(loaded, {**base, "prefix_loading": "impress"}, stores[True, False], firsts)
        reordered = Path(scratch) / "reordered"
        start = time.perf_counter()
        report["nodes_reordered"] = reorder_after(
            loaded, {**base, "prefix_loading": "impress", "kv_store": f"disk:{reordered}:16GiB"}, warm, CHUNK_TOKENS)
        report["reorder_setup_seconds"] = round(time.perf_counter() - start, 1)
        stores[True, True] = reordered
        host_bytes = int(args.host_share * pool_bytes)
        report.update(pool_bytes=pool_bytes, host_bytes=host_bytes)
        for name in args.systems.split(","):
            start = time.perf_counter()
            if name == "recompute":
                row = serve_trace(loaded, {"threads": 2}, trace, None)
            else:
                loading, eviction, reorders = SYSTEMS[name]
                directory = Path(scratch) / f"run-{name}"
                shutil.copytree(stores[loading == "impress", reorders], directory)
                options = {**base, "prefix_loading": loading, "kv_store_eviction": eviction,
                           "kv_store": f"host:{host_bytes}B,disk:{directory}:16GiB"}
                row = serve_trace(loaded, options, trace, directory)
                shutil.rmtree(directory)
            row["seconds"] = round(time.perf_counter() - start, 1)
            report["systems"][name] = row
            print(name, json.dumps(row), file=sys.stderr, flush=True)
    add_ratios(report["systems"])
    print(json.dumps(report, indent=2))


def add_ratios(rows: dict) -> None:
    """Each system's time to first token and disk bytes against the baselines measured in the same run."""
    for baseline in ("recompute", "full+lru", "impress+reorder+lru"):
        if baseline not in rows:
            continue
        for row in rows.values():
            row[f"p50_ttft_vs_{baseline}"] = round(row["p50_ttft_ms"] / rows[baseline]["p50_ttft_ms"], 3)
            if "disk_bytes_read_per_request" in row and rows[baseline].get("disk_bytes_read_per_request"):
                row[f"disk_bytes_vs_{baseline}"] = round(
                    row["disk_bytes_read_per_request"] / rows[baseline]["disk_bytes_read_per_request"], 3)


if __name__ == "__main__":
    main()
