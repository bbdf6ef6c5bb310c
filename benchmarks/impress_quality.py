"""Quality and bytes of prefix loading by importance through the KV store (issue 14; docs/BENCHMARKS.md, "What a
load by importance costs in quality").

    python -m benchmarks.impress_quality > benchmarks/results/impress_quality.json

For each text (Persuasion, the Python tutorial), `--prefixes` windows of the text: a stored prefix of
`--prefix-tokens` tokens, the `--prompt-tokens` tokens after it (the prompt's new tokens, from which each layer
chooses) and the `--scored-tokens` after those, scored teacher-forced through the engine's paged cache (64 per
step) against recomputing the whole window: perplexity and top-1 agreement. The prefix comes from a disk tier in
float16, written by an earlier engine, and is read as the engine reads it: layer by layer through the store,
each layer's choice from the prompt's tokens, reordered nodes through their maps; the scored tokens then attend
to what each layer read, never to the rest. Bytes are counted by the store as read, against reading every
chunk's K and V objects.

Systems: IMPRESS with each shared-set rule and attended set, keys-only H2O, at each of `--ratios`; "+reorder"
loads `--warm-questions` other prompts per prefix first (a passage from elsewhere in the text and a question
line, as benchmarks/impress_loading.py's), then runs one reordering pass, before the measured windows load.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.impress_loading import QUESTION, QUESTION_TOKENS, TEXTS, reorder_after, store_prefix
from kvstrata.bench.report import machine_info
from kvstrata.config import EngineConfig
from kvstrata.engine.important_prefix_load import ImportantLoadStats, StorePrefix, load_important_prefix
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.eval.cache_scorer import CacheScorer

# (name, options, reordered): the paper's choice, its chunk-mates attended too, whole chunks; keys-only H2O
SYSTEMS = [
    ("impress vote, chosen", {"prefix_loading": "impress", "impress_rule": "vote", "impress_attend": "chosen"}, False),
    ("impress vote, read", {"prefix_loading": "impress", "impress_rule": "vote", "impress_attend": "read"}, False),
    ("impress chunks", {"prefix_loading": "impress", "impress_rule": "chunks"}, False),
    ("h2o-keys, chosen", {"prefix_loading": "h2o-keys", "impress_attend": "chosen"}, False),
    ("h2o-keys, read", {"prefix_loading": "h2o-keys", "impress_attend": "read"}, False),
    ("impress vote, chosen +reorder", {"prefix_loading": "impress", "impress_rule": "vote",
                                       "impress_attend": "chosen"}, True),
    ("impress vote, read +reorder", {"prefix_loading": "impress", "impress_rule": "vote",
                                     "impress_attend": "read"}, True),
    ("impress chunks +reorder", {"prefix_loading": "impress", "impress_rule": "chunks"}, True),
]
SCORED_PER_STEP = 64


def windows(engine: LLMEngine, name: str, count: int, span: int, prefix_tokens: int, warm_questions: int,
            seed: int) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """`count` windows of `span` tokens at random starts, and `warm_questions` prompts per window's prefix (its
    prefix, a passage from elsewhere, a question line) as (window index, prompt)."""
    rng = random.Random(seed)
    ids = engine.tokenize(TEXTS[name].read_text(encoding="utf-8"))
    question_line = engine.tokenize(QUESTION)
    measured, warm = [], []
    for index in range(count):
        start = rng.randrange(0, len(ids) - span)
        measured.append(ids[start : start + span])
        for _ in range(warm_questions):
            at = rng.randrange(0, len(ids) - QUESTION_TOKENS)
            warm.append((index, ids[start : start + prefix_tokens] + ids[at : at + QUESTION_TOKENS] + question_line))
    return measured, warm


def scored_log_probs(engine: LLMEngine, window: list[int], prompt_len: int, preloaded=()) -> torch.Tensor:
    logits = CacheScorer(engine).next_token_logits(window, prompt_len, SCORED_PER_STEP, list(preloaded))
    return logits.float().log_softmax(-1).cpu()


def every_chunk_bytes(engine: LLMEngine, prefix: list[int]) -> int:
    """What reading every chunk's K and V objects of the stored prefix costs, in every layer."""
    link = engine.kv_store
    found = link.find(link.chunk_keys(prefix, len(prefix) // link.chunk_tokens))
    reader = StorePrefix(link.store, found, link.chunk_tokens, "h2o-keys")  # reads no map
    everything = torch.ones(reader.num_tokens, dtype=torch.bool)
    for layer in range(engine.loaded.config.num_layers):
        reader.chosen_kv(layer, everything)
    return reader.bytes_read


def run_system(loaded, options: dict, measured: list[list[int]], warm, prompt_len: int, prefix_tokens: int,
               reference: list[torch.Tensor]) -> dict:
    """One system's row; `warm`: prompts loaded, then the store reordered, before the measured windows (None: the
    windows' prefixes are stored as they were computed)."""
    row: dict = {}
    if warm is not None:
        row["nodes_reordered"] = reorder_after(loaded, options, warm, options["kv_store_chunk_tokens"])
    nll, agreement, full_bytes, totals = [], [], 0, ImportantLoadStats()
    for window, expected in zip(measured, reference):
        prompt = window[:prompt_len]
        if warm is None:
            store_prefix(loaded, options, prompt)
        engine = LLMEngine(EngineConfig(**options), loaded=loaded)  # after the writes: its disk index holds them
        link = engine.kv_store
        found = link.find(link.chunk_keys(prompt, prefix_tokens // link.chunk_tokens))
        if len(found) * link.chunk_tokens != prefix_tokens:
            raise RuntimeError(f"the store holds {len(found)} chunks of a {prefix_tokens}-token prefix")
        kv = load_important_prefix(link.important, link.store, found, link.chunk_tokens, prompt, totals)
        full_bytes += every_chunk_bytes(engine, prompt[:prefix_tokens])
        log_probs = scored_log_probs(engine, window, prompt_len, [kv])
        link.close()
        targets = torch.tensor(window[prompt_len:])
        nll.append(-log_probs.gather(1, targets[:, None]).mean().item())
        agreement.append((log_probs.argmax(-1) == expected.argmax(-1)).float().mean().item())
    return {**row, "perplexity": math.exp(sum(nll) / len(nll)), "mean_nll": sum(nll) / len(nll),
            "top1_agreement_vs_recompute": sum(agreement) / len(agreement),
            "bytes_vs_every_chunk": totals.bytes_read / full_bytes,
            "bytes_read_per_load": totals.bytes_read / len(measured),
            "every_chunk_bytes_per_load": full_bytes / len(measured),
            "chunk_reads_per_load": totals.chunk_reads / totals.loads,
            "fallback_share": totals.fallbacks / totals.layers,
            "chosen_token_share": totals.tokens_chosen / totals.tokens_offered,
            "attended_token_share": totals.tokens_read / totals.tokens_offered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--scored-tokens", type=int, default=256)
    parser.add_argument("--warm-questions", type=int, default=3)
    parser.add_argument("--ratios", default="0.25,0.5")
    parser.add_argument("--chunk-tokens", type=int, default=64, help="tokens per stored chunk: the unit of a read")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default=None,
                        help="only these systems, separated by ';' (e.g. 'impress chunks;impress chunks +reorder')")
    args = parser.parse_args()
    systems = [s for s in SYSTEMS if args.systems is None or s[0] in args.systems.split(";")]
    prompt_len = args.prefix_tokens + args.prompt_tokens
    report = {"machine": machine_info(), "prefix_tokens": args.prefix_tokens, "prompt_tokens": args.prompt_tokens,
              "scored_tokens": args.scored_tokens, "chunk_tokens": args.chunk_tokens, "texts": {}}
    first = LLMEngine(EngineConfig(threads=2))
    with tempfile.TemporaryDirectory() as scratch:
        for name in TEXTS:
            measured, warm = windows(first, name, args.prefixes, prompt_len + args.scored_tokens, args.prefix_tokens,
                                     args.warm_questions, args.seed)
            reference = [scored_log_probs(first, window, prompt_len) for window in measured]
            targets = [torch.tensor(window[prompt_len:]) for window in measured]
            recompute_nll = sum(-r.gather(1, t[:, None]).mean().item() for r, t in zip(reference, targets))
            rows = {"recompute": {"perplexity": math.exp(recompute_nll / len(measured))}}
            for ratio in (float(r) for r in args.ratios.split(",")):
                for system, options, reordered in systems:
                    start = time.perf_counter()
                    key = f"{system} r={ratio}"
                    directory = Path(scratch) / f"{name}-{key}".replace(" ", "_").replace(",", "")
                    options = {**options, "threads": 2, "impress_ratio": ratio, "kv_store": f"disk:{directory}:8GiB",
                               "kv_store_format": "fp16", "kv_store_chunk_tokens": args.chunk_tokens,
                               "impress_reorder_seconds": 0}
                    row = run_system(first.loaded, options, measured, warm if reordered else None, prompt_len,
                                     args.prefix_tokens, reference)
                    row["perplexity_vs_recompute"] = row["perplexity"] / rows["recompute"]["perplexity"] - 1
                    row["seconds"] = time.perf_counter() - start
                    rows[key] = row
                    print(name, key, json.dumps(row), file=sys.stderr, flush=True)
            report["texts"][name] = rows
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
