"""Prefix-cache reuse of long documents under a sliding window when the pool hands out their first blocks
(KVCacheManager.match_prefix; docs/BENCHMARKS.md, "Sliding window: prefixes whose head left the pool").

    .venv/bin/python -m benchmarks.sliding_window_prefix > benchmarks/results/sliding_window_prefix.json

A sequence under a sliding window gives its leading blocks back to the pool as it moves past them, so they are the
first cached blocks the pool hands out again. A prompt that repeats a document then finds the document's head gone:
matched from the first block on, as every prefix was before, it reuses nothing; matched where the blocks its first
new query reads are cached, it reuses the document up to there. Run this command on two checkouts to compare them.

No model shipped here has a sliding window, so the default model runs with one imposed (`--window`, as in
benchmarks/sliding_window_capacity.py): this measures reuse and time, never quality. Two documents of `--document-len`
tokens (the start of Emma and of the Python tutorial) are asked `--rounds` questions each, taking turns, one
request at a time, each `--output-len` greedy tokens, in a float32 KV pool of `--budget-requests` requests of full
length: each document's request pushes the other's head out. Reported per request: its time to first token (from
its arrival), its prompt tokens read from the prefix cache; in all, the share of prompt tokens reused after the
first round, the median TTFT of those requests, and a digest of every output's tokens (equal digests: equal
outputs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics

import torch

from benchmarks.kv_store_ttft import QUESTIONS, TEXTS, first_token
from benchmarks.sliding_window_capacity import with_window
from kvstrata.bench.report import machine_info
from kvstrata.config import EngineConfig
from kvstrata.engine.kv_setup import engine_storage_layout
from kvstrata.engine.llm_engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--document-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--budget-requests", type=float, default=1.5,
                        help="the KV pool, in requests of full length (default: 1.5)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    reference = LLMEngine(EngineConfig(threads=args.threads, kv_cache_memory="64MiB", max_model_len=1024))
    documents = {name: reference.tokenize(TEXTS[name].read_text(encoding="utf-8"))[: args.document_len]
                 for name in ("emma", "python_tutorial")}
    questions = [reference.tokenize(q) for q in QUESTIONS]
    request_tokens = args.document_len + max(len(q) for q in questions) + args.output_len
    bytes_per_token = engine_storage_layout(reference, torch.float32, "fp32").bytes_per_token
    budget = int(args.budget_requests * request_tokens * bytes_per_token)
    config = EngineConfig(threads=args.threads, kv_cache_memory=budget, max_model_len=request_tokens)
    engine = LLMEngine(config, loaded=with_window(reference.loaded, args.window))
    del reference
    first_token(engine, questions[0] * 8, 2)  # warm-up: kernels, buffers
    engine.reset_prefix_cache()

    rows, digest = [], hashlib.sha256()
    for round_index in range(args.rounds):
        for name, document in documents.items():
            prompt = document + questions[round_index % len(questions)]
            output = first_token(engine, prompt, args.output_len, ignore_eos=True)
            digest.update(json.dumps(output.token_ids).encode())
            rows.append({"round": round_index, "document": name, "prompt_tokens": len(prompt),
                         "cached_tokens": output.num_cached_tokens, "ttft_s": round(output.metrics.ttft, 3)})
    reused = [row for row in rows if row["round"] > 0]
    print(json.dumps({
        "benchmark": "sliding_window_prefix",
        "machine": machine_info(),
        "model": engine.loaded.name,
        "workload": {"window": args.window, "document_len": args.document_len, "rounds": args.rounds,
                     "output_len": args.output_len, "budget_requests": args.budget_requests,
                     "kv_budget_bytes": budget, "pool_blocks": engine.kv_manager.pool.num_blocks,
                     "documents": list(documents)},
        "reused_share_after_first_round": round(sum(r["cached_tokens"] for r in reused)
                                                / sum(r["prompt_tokens"] for r in reused), 3),
        "median_ttft_after_first_round_s": round(statistics.median(r["ttft_s"] for r in reused), 3),
        "median_ttft_first_round_s": round(statistics.median(r["ttft_s"] for r in rows if r["round"] == 0), 3),
        "outputs_digest": digest.hexdigest()[:16],
        "requests": rows,
    }, indent=2))


if __name__ == "__main__":
    main()
