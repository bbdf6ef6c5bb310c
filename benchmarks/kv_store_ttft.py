"""The KV store below the paged cache: time to first token of reused contexts (docs/BENCHMARKS.md, "KV store").

    python -m benchmarks.kv_store_ttft --part target > benchmarks/results/kv_store_target.json
    python -m benchmarks.kv_store_ttft --part reuse > benchmarks/results/kv_store_reuse.json
    python -m benchmarks.kv_store_ttft --part together > benchmarks/results/kv_store_together.json

`target`: for a 4,000-token context of each text (Austen's Emma and the Python tutorial), time to first token
of context + question when it is recomputed (a fresh engine, no store) and when a fresh engine finds it in
Redis in each stored form (written there by another engine first); the perplexity of the 512 tokens after the
context, scored through KV fetched from the store, against scoring through recomputed KV. TTFT counts from
the request's arrival: lookup, fetch and decode of stored KV included. Perplexities are scored with the same
weights in float32 (`--weights fp32`): the default int4 kernels take activations in bfloat16, whose rounding
moves one window's perplexity by up to about 1% when the KV changes by float rounding alone.

`together`: the 4,000-token context of each text in Redis in each stored form (`--together-forms`), and a fresh
engine given three questions about it at once: each request's TTFT, the bytes read from Redis and the prompt
tokens prefilled, against the same three requests recomputed (prefix caching on: the context is computed once).

`reuse`: passages of 2,000-4,000 tokens from three texts, each asked several questions in random order (fixed
seed), one request at a time, with a device KV budget that holds about two passages; TTFT p50/p99, each tier's
hit ratio and the bytes moved, for no store (recompute) and each store configuration.

Redis is a real redis-server on loopback, started here; its link is loopback (nothing is modeled).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvstrata.bench.redis_server import RedisServer
from kvstrata.bench.report import machine_info
from kvstrata.bench.stats import summarize
from kvstrata.config import EngineConfig
from kvstrata.data import EMMA
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.eval.cache_scorer import CacheScorer
from kvstrata.kv.preloaded import PreloadedKV

DATA = Path(__file__).parent / "data"
TEXTS = {"emma": EMMA, "persuasion": DATA / "persuasion.txt", "python_tutorial": DATA / "python_tutorial.txt"}
CONTEXT_TOKENS = 4000
SCORED_TOKENS = 512
QUESTIONS = ["\n\nQuestion: Who is speaking in the last paragraph?\nAnswer:",
             "\n\nQuestion: Summarise the passage above in one sentence.\nAnswer:",
             "\n\nQuestion: What happens next?\nAnswer:"]


def engine(**options) -> LLMEngine:
    return LLMEngine(EngineConfig(threads=2, **options))


def first_token(engine: LLMEngine, token_ids: list[int], max_tokens: int = 1, ignore_eos: bool = False):
    """Run one request alone, greedy; its final output (metrics.ttft counts from add_request)."""
    engine.add_request(token_ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                return output
    raise RuntimeError("the request did not finish")


def window(engine: LLMEngine, name: str, offset: int = 60_000) -> list[int]:
    text = TEXTS[name].read_text(encoding="utf-8")[offset : offset + 60_000]
    return engine.tokenize(text)[: CONTEXT_TOKENS + SCORED_TOKENS]


def perplexity(engine: LLMEngine, token_ids: list[int], preloaded: list[PreloadedKV]) -> float:
    logits = CacheScorer(engine).next_token_logits(token_ids, CONTEXT_TOKENS, tokens_per_step=64, preloaded=preloaded)
    targets = torch.tensor(token_ids[CONTEXT_TOKENS:])
    return torch.nn.functional.cross_entropy(logits, targets).exp().item()


def stored_kv(reader: LLMEngine, context: list[int]) -> list[PreloadedKV]:
    """The context's chunks as the store hands them out (fetched, checked, decoded)."""
    link = reader.kv_store
    keys = link.chunk_keys(context, len(context) // link.chunk_tokens)
    ks, vs = zip(*(link.store.fetch(key, link.chunk_tokens) for key in keys))
    return [PreloadedKV(0, torch.cat(ks, dim=1), torch.cat(vs, dim=1))]


@contextlib.contextmanager
def writer_and_reader(redis: RedisServer, form: str, prompt: list[int]):
    """An engine that wrote `prompt`'s chunks to the emptied Redis in `form`, and a fresh one (empty device pool)
    on the same store. Both are closed afterwards: each form's engines run alone, the earlier ones' threads and
    memory gone."""
    store = {"kv_store": redis.url, "kv_store_format": form}
    redis.flush()
    writer = engine(**store)
    first_token(writer, prompt)
    writer.kv_store.flush()
    reader = engine(**store)
    try:
        yield writer, reader
    finally:
        writer.close()
        reader.close()
        gc.collect()


def run_target(forms: list[str], redis: RedisServer) -> dict:
    results = {}
    recompute_engine = engine()
    # Exact arithmetic: the stored forms' KV (the int4 engine's prefill, whose products are dense float32) and the
    # scorer's own for the baseline agree to float rounding (the raw row), so the rows differ by their KV's form.
    scorer = engine(weights="fp32")
    for name in ("emma", "python_tutorial"):
        ids = window(recompute_engine, name)
        context = ids[:CONTEXT_TOKENS]
        prompt = context + recompute_engine.tokenize(QUESTIONS[0])
        recomputed = first_token(engine(), prompt)
        row = {"prompt_tokens": len(prompt), "recompute_ttft_s": recomputed.metrics.ttft, "perplexity_weights": "fp32",
               "recompute_perplexity": perplexity(scorer, ids, []), "forms": {}}
        for form in forms:
            with writer_and_reader(redis, form, prompt) as (writer, reader):
                loaded = first_token(reader, prompt)
                tier, loaded_tokens = reader.kv_store.store.tiers[0].stats, reader.kv_store.stats.loaded_tokens
                row["forms"][form] = {
                    "ttft_s": loaded.metrics.ttft,
                    "speedup_vs_recompute": recomputed.metrics.ttft / loaded.metrics.ttft,
                    "loaded_tokens": loaded_tokens, "bytes_read": tier.bytes_read,
                    "bytes_per_token": tier.bytes_read / max(loaded_tokens, 1),
                    "fetch_s": tier.fetch_seconds, "decode_s": reader.kv_store.store.stats.decode_seconds,
                    "encode_s": writer.kv_store.store.stats.encode_seconds,
                    "same_first_token": loaded.token_ids == recomputed.token_ids,
                }
                quality = perplexity(scorer, ids, stored_kv(reader, context))  # fetches again: after the counters
                row["forms"][form].update(perplexity=quality,
                                          perplexity_vs_recompute=quality / row["recompute_perplexity"] - 1)
            print(name, form, json.dumps(row["forms"][form]), file=sys.stderr, flush=True)
        results[name] = row
    return results


def together(engine: LLMEngine, prompts: list[list[int]]) -> dict:
    """The prompts arrive at once (greedy, one token each): their TTFTs and the prompt tokens prefilled."""
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    ttfts, prefilled = [], 0
    while engine.has_unfinished_requests():
        steps = len(engine.step_stats)
        ttfts += [output.metrics.ttft for output in engine.step() if output.finished]
        prefilled += engine.step_stats[-1].prefill_tokens if len(engine.step_stats) > steps else 0  # a step ran
    return {"ttft_s": ttfts, "mean_ttft_s": sum(ttfts) / len(ttfts), "last_ttft_s": max(ttfts),
            "prefilled_tokens": prefilled}


def run_together(forms: list[str], redis: RedisServer) -> dict:
    results = {}
    tokenizer = engine()
    for name in ("emma", "python_tutorial"):
        context = window(tokenizer, name)[:CONTEXT_TOKENS]
        prompts = [context + tokenizer.tokenize(question) for question in QUESTIONS]
        row = {"prompt_tokens": [len(p) for p in prompts], "recompute": together(engine(), prompts), "forms": {}}
        for form in forms:
            with writer_and_reader(redis, form, prompts[0]) as (_, reader):
                timed = together(reader, prompts)
                row["forms"][form] = {
                    **timed, "bytes_read": reader.kv_store.store.tiers[0].stats.bytes_read,
                    "loaded_tokens": reader.kv_store.stats.loaded_tokens,
                    "decode_s": reader.kv_store.store.stats.decode_seconds,
                    "mean_ttft_speedup_vs_recompute": row["recompute"]["mean_ttft_s"] / timed["mean_ttft_s"],
                }
            print(name, form, json.dumps(row["forms"][form]), file=sys.stderr, flush=True)
        results[name] = row
    return results


def reuse_workload(tokenizer_engine: LLMEngine, passages: int, questions: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    names = list(TEXTS)
    contexts = []
    for index in range(passages):
        text = TEXTS[names[index % len(names)]].read_text(encoding="utf-8")
        start = rng.randrange(0, len(text) - 40_000)
        ids = tokenizer_engine.tokenize(text[start : start + 40_000])
        contexts.append(ids[: rng.randrange(2000, 4001)])
    asks = [(p, q) for p in range(passages) for q in range(questions)]
    rng.shuffle(asks)
    question_ids = [tokenizer_engine.tokenize(q) for q in QUESTIONS]
    return [contexts[p] + question_ids[q % len(QUESTIONS)] for p, q in asks]


def run_reuse(systems: dict[str, dict], passages: int, questions: int, seed: int, budget: str,
              redis: RedisServer) -> dict:
    prompts = reuse_workload(engine(), passages, questions, seed)
    results = {"requests": len(prompts), "passages": passages, "questions_per_passage": questions,
               "prompt_tokens": [len(p) for p in prompts], "kv_cache_memory": budget, "systems": {}}
    for name, options in systems.items():
        redis.flush()  # every system starts from an empty store
        run = engine(kv_cache_memory=budget, max_model_len=4200, **options)
        start = time.perf_counter()
        ttfts = [first_token(run, prompt, max_tokens=8).metrics.ttft for prompt in prompts]
        row = {**summarize(ttfts, "ttft_ms", scale=1000), "seconds": time.perf_counter() - start,
               "device_prefix_hit_rate": run.kv_manager.prefix_stats.hit_rate}
        if run.kv_store is not None:
            run.kv_store.flush()
            row["tiers"] = {t.name: {**t.stats.to_json(), "hit_ratio": t.stats.hit_tokens /
                                     max(t.stats.hit_tokens + t.stats.miss_tokens, 1)}
                            for t in run.kv_store.store.tiers}
            row["store"] = {**run.kv_store.store.stats.to_json(), **run.kv_store.stats.to_json()}
            run.kv_store.close()
        results["systems"][name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "tiers"}), file=sys.stderr, flush=True)
    base = results["systems"].get("recompute")
    if base is not None:
        for row in results["systems"].values():
            row["p50_ttft_speedup_vs_recompute"] = base["p50_ttft_ms"] / row["p50_ttft_ms"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("target", "reuse", "together", "all"), default="all")
    parser.add_argument("--forms", default="raw,fp16,high,medium,low", help="stored forms for --part target")
    parser.add_argument("--together-forms", default="fp16,medium", help="stored forms for --part together")
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", default="300MiB", help="device KV budget for --part reuse (about two passages)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        redis = RedisServer(Path(scratch)).start()
        try:
            report = {"machine": machine_info(), "redis": "redis-server on loopback, started by this script"}
            if args.part in ("target", "all"):
                report["target"] = run_target(args.forms.split(","), redis)
            if args.part in ("together", "all"):
                report["together"] = run_together(args.together_forms.split(","), redis)
            if args.part in ("reuse", "all"):
                systems = {
                    "recompute": {},
                    "host_fp16": {"kv_store": "host:2GiB", "kv_store_format": "fp16"},
                    "disk_fp16": {"kv_store": f"disk:{scratch}/disk:4GiB", "kv_store_format": "fp16"},
                    "redis_raw": {"kv_store": redis.url},
                    "redis_fp16": {"kv_store": redis.url, "kv_store_format": "fp16"},
                    "redis_high": {"kv_store": redis.url, "kv_store_format": "high"},
                    "redis_medium": {"kv_store": redis.url, "kv_store_format": "medium"},
                }
                report["reuse"] = run_reuse(systems, args.passages, args.questions, args.seed, args.budget, redis)
        finally:
            redis.stop()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
