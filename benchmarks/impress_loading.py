"""Prefix loading by importance in the engine (`--prefix-loading`, issue 14; docs/BENCHMARKS.md, "IMPRESS in the
engine").

    python -m benchmarks.impress_loading > benchmarks/results/impress_loading.json

A prefix-reuse workload on the default model: for each text (Persuasion, the Python tutorial), `--prefixes`
passages of `--prefix-tokens` tokens, each asked `--questions` different questions (a 64-token passage from
elsewhere in the text, then a question line). Every question is served by a fresh engine (the model shared)
whose device pool is empty, so its prefix comes from the KV store, written there by an earlier engine of the
same configuration. Per system: time to first token, what the store read (bytes, (chunk, layer) reads, the
share of layers falling back and of prefix tokens chosen), and greedy agreement of `--gen-tokens` generated
tokens with recomputing the prefix.

Chunks are stored in float16, `--chunk-tokens` tokens each (the read unit; 64 by default, the paper's). Tiers:
`disk` (the chunk files are dropped from the page cache with posix_fadvise before every question, so reads are
cold) and `redis` behind a link emulated at `--link-gbps` (modeled: the bytes cross loopback to a real
redis-server, then wait for the emulated link).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.kv_store_ttft import first_token
from kvstrata.bench.redis_server import RedisServer
from kvstrata.bench.report import machine_info
from kvstrata.bench.stats import summarize
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.kv.impress.important_tokens import SHARED_SET_RULES
from kvstrata.kv.impress.node_reordering import reorder_all
from kvstrata.kv.impress.prefix_selection import ATTENDED

DATA = Path(__file__).parent / "data"
TEXTS = {"persuasion": DATA / "persuasion.txt", "python_tutorial": DATA / "python_tutorial.txt"}
QUESTION_TOKENS = 64
QUESTION = "\n\nQuestion: How does the passage just above relate to the text before it?\nAnswer:"


def workload(engine: LLMEngine, name: str, prefixes: int, prefix_tokens: int, questions: int, warm_questions: int,
             seed: int) -> tuple[list[tuple[int, list[int]]], list[tuple[int, list[int]]]]:
    """(prefix index, prompt) pairs, each prefix followed by each of its questions: the measured ones, and
    `warm_questions` others per prefix (drawn apart, so the measured ones do not depend on their number)."""
    rng, warm_rng = random.Random(seed), random.Random(seed + 1)
    ids = engine.tokenize(TEXTS[name].read_text(encoding="utf-8"))
    question_line = engine.tokenize(QUESTION)
    prompts, warm = [], []
    for p in range(prefixes):
        start = rng.randrange(0, len(ids) - prefix_tokens)
        prefix = ids[start : start + prefix_tokens]
        for draws, pairs, count in ((rng, prompts, questions), (warm_rng, warm, warm_questions)):
            for _ in range(count):
                at = draws.randrange(0, len(ids) - QUESTION_TOKENS)
                pairs.append((p, prefix + ids[at : at + QUESTION_TOKENS] + question_line))
    return prompts, warm


def drop_page_cache(directory: Path) -> None:
    """Make the next reads of the disk tier's files cold: written back, then dropped from the page cache."""
    for path in directory.glob("*.kvc"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def store_prefix(loaded, base: dict, token_ids: list[int]) -> None:
    """An earlier engine stores the chunks of `token_ids` (a prompt's prefix and what follows it)."""
    writer = LLMEngine(EngineConfig(**base), loaded=loaded)
    first_token(writer, token_ids, 1)
    writer.kv_store.flush()
    writer.kv_store.close()


def reorder_after(loaded, base: dict, warm_prompts, chunk_tokens: int) -> int:
    """IMPRESS's reordering step: other questions of each prefix are loaded by importance first (each load adds
    to its nodes' running importance), then one reordering pass rewrites the nodes; the nodes rewritten."""
    written = set()
    for prefix, prompt in warm_prompts:
        if prefix not in written:
            store_prefix(loaded, base, prompt[:-QUESTION_TOKENS])
            written.add(prefix)
        engine = LLMEngine(EngineConfig(**base), loaded=loaded)
        first_token(engine, prompt, 1)
        engine.kv_store.close()
    engine = LLMEngine(EngineConfig(**base), loaded=loaded)
    rewritten = reorder_all(engine.kv_store.store, chunk_tokens)
    engine.kv_store.close()
    return rewritten


def run_system(loaded, options: dict, prompts, gen_tokens: int, reference: list[list[int]] | None,
               disk_dir: Path | None, warm_prompts=None) -> tuple[dict, list[list[int]]]:
    """The system's row and every request's generated tokens (`warm_prompts`: loaded, then the store reordered,
    before the measured prompts)."""
    base = {"threads": 2, **options}
    written = set()
    ttfts, agreement, first_same, outputs = [], [], [], []
    totals = {"bytes_read": 0, "chunk_reads": 0, "layers": 0, "fallbacks": 0, "tokens_offered": 0,
              "tokens_chosen": 0, "tokens_read": 0, "loaded_requests": 0}
    if warm_prompts:
        totals["nodes_reordered"] = reorder_after(loaded, base, warm_prompts, options["kv_store_chunk_tokens"])
        written = {prefix for prefix, _ in warm_prompts}
    for index, (prefix, prompt) in enumerate(prompts):
        if "kv_store" in options and prefix not in written:
            store_prefix(loaded, base, prompt[:-QUESTION_TOKENS])
            written.add(prefix)
        if disk_dir is not None:
            drop_page_cache(disk_dir)
        engine = LLMEngine(EngineConfig(**base), loaded=loaded)
        output = first_token(engine, prompt, gen_tokens)
        ttfts.append(output.metrics.ttft)
        outputs.append(output.token_ids)
        if reference is not None:
            agreement.append(sum(a == b for a, b in zip(output.token_ids, reference[index])) / gen_tokens)
            first_same.append(output.token_ids[0] == reference[index][0])
        if engine.kv_store is not None:
            link = engine.kv_store
            totals["loaded_requests"] += link.stats.requests_loaded
            if link.important is not None:
                for key in ("chunk_reads", "layers", "fallbacks", "tokens_offered", "tokens_chosen", "tokens_read"):
                    totals[key] += getattr(link.important_stats, key)
            totals["bytes_read"] += sum(tier.stats.bytes_read for tier in link.store.tiers)
            link.close()
    row = {**summarize(ttfts, "ttft_ms", scale=1000), "requests": len(prompts), **totals,
           "bytes_read_per_request": totals["bytes_read"] / len(prompts)}
    if totals["layers"]:
        row["fallback_share"] = totals["fallbacks"] / totals["layers"]
        row["chosen_token_share"] = totals["tokens_chosen"] / totals["tokens_offered"]
        row["attended_token_share"] = totals["tokens_read"] / totals["tokens_offered"]
    if reference is not None:
        row["greedy_agreement_vs_recompute"] = sum(agreement) / len(agreement)
        row["first_token_same_as_recompute"] = sum(first_same) / len(first_same)
    return row, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", type=int, default=2)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--warm-questions", type=int, default=3,
                        help="impress+reorder: questions per prefix loaded before the reordering pass (not measured)")
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--ratios", default="0.25,0.5")
    parser.add_argument("--link-gbps", default="1")
    parser.add_argument("--chunk-tokens", type=int, default=64, help="tokens per stored chunk: the unit of a read")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--impress-rule", default="vote", choices=SHARED_SET_RULES)
    parser.add_argument("--impress-attend", default="read", choices=ATTENDED,
                        help="the selective systems attend every token of the chunks read, or only the chosen ones")
    parser.add_argument("--systems", default=None,
                        help="only these systems, comma-separated (e.g. 'full,impress+reorder r=0.25'; recompute "
                             "always runs, as every row's reference)")
    parser.add_argument("--tiers", default="disk,redis")
    args = parser.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    tiers = args.tiers.split(",")
    report = {"machine": machine_info(), "prefix_tokens": args.prefix_tokens, "questions": args.questions,
              "impress_rule": args.impress_rule, "impress_attend": args.impress_attend,
              "chunk_tokens": args.chunk_tokens, "link_gbps_modeled": args.link_gbps, "texts": {}}
    with tempfile.TemporaryDirectory() as scratch:
        redis = RedisServer(Path(scratch)).start()
        try:
            first = LLMEngine(EngineConfig(threads=2))
            loaded = first.loaded
            first_token(first, first.tokenize(QUESTION * 200), 2)  # warm-up: kernels and allocator, off the clock
            for name in TEXTS:
                prompts, warm = workload(first, name, args.prefixes, args.prefix_tokens, args.questions,
                                         args.warm_questions, args.seed)
                rows = {}
                rows["recompute"], reference = run_system(loaded, {}, prompts, args.gen_tokens, None, None)
                methods = [("full", {"prefix_loading": "full"})]
                methods += [(f"{method} r={ratio}", {"prefix_loading": method, "impress_ratio": ratio,
                                                     "impress_rule": args.impress_rule,
                                                     "impress_attend": args.impress_attend})
                            for ratio in ratios for method in ("h2o-keys", "impress", "impress+reorder")]
                if args.systems is not None:
                    methods = [(name, options) for name, options in methods if name in args.systems.split(",")]
                for tier in tiers:
                    for method, options in methods:
                        if tier == "disk":
                            directory = Path(scratch) / f"disk-{name}-{method.replace(' ', '_')}"
                            store = {"kv_store": f"disk:{directory}:8GiB"}
                        else:
                            directory = None
                            redis.flush()
                            store = {"kv_store": redis.url, "kv_store_link_gbps": args.link_gbps}
                        start = time.perf_counter()
                        store.update(kv_store_format="fp16", kv_store_chunk_tokens=args.chunk_tokens)
                        reorders = options.get("prefix_loading") == "impress+reorder"
                        if reorders:
                            options = {**options, "prefix_loading": "impress"}
                        options["impress_reorder_seconds"] = 0  # the benchmark runs its pass itself
                        row, _ = run_system(loaded, {**store, **options}, prompts, args.gen_tokens, reference,
                                            directory, warm if reorders else None)
                        row["seconds"] = time.perf_counter() - start
                        rows[f"{tier} {method}"] = row
                        print(name, tier, method, json.dumps(row), file=sys.stderr, flush=True)
                recompute = rows["recompute"]["p50_ttft_ms"]
                for row in rows.values():
                    row["p50_ttft_speedup_vs_recompute"] = round(recompute / row["p50_ttft_ms"], 3)
                if any(name == "full" for name, _ in methods):  # bytes against full's, where it ran
                    for tier in tiers:
                        full = rows[f"{tier} full"]["bytes_read"]
                        for key, row in rows.items():
                            if key.startswith(tier):
                                row["bytes_vs_full"] = round(row["bytes_read"] / full, 4)
                report["texts"][name] = rows
        finally:
            redis.stop()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
