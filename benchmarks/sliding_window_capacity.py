"""What giving back the blocks behind a sliding window buys when the KV budget caps the batch
(KVCacheManager.release_behind_window; docs/DESIGN.md, "Policy").

    .venv/bin/python -m benchmarks.sliding_window_capacity > benchmarks/results/sliding_window_capacity.json

No model shipped here has a sliding window, so the default model runs with one imposed (`--window`, set as its
ModelConfig.sliding_window): each query reads only its last `window` keys. Past the window its outputs are not
what it was trained to give, so this measures memory and speed, never quality; both runs of a pair compute the
same tokens (tests/test_sliding_window.py proves that on tiny models). `--requests` requests of `--prompt-len`
prompt tokens (windows of Emma) and `--output-len` greedy output tokens arrive at once, through
kvstrata.bench.throughput.run_kvstrata (sarathi scheduler), at a fp32 KV budget that holds `--full-batch` of them
whole. The `keep` run holds every block of a sequence till it ends (the cache manager's window unset: the engine
before this change); the `give-back` run returns the blocks behind the window as its sequences move on. Runs go
keep, give-back, give-back, keep, ... over `--pairs` pairs, since this machine's speed drifts within a command;
each pair's ratio is give-back's output tokens/s over keep's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from kvstrata.bench.report import machine_info, sig
from kvstrata.bench.throughput import run_kvstrata
from kvstrata.bench.workload import parse_length, sample_requests
from kvstrata.config import EngineConfig
from kvstrata.data import EMMA
from kvstrata.engine.kv_setup import engine_storage_layout
from kvstrata.engine.llm_engine import LLMEngine


def with_window(loaded, window: int):
    """The loaded model with a sliding window of `window` tokens imposed (its weights shared)."""
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, sliding_window=window))


def keep_every_block(engine: LLMEngine) -> None:
    engine.kv_manager.window = None


def run(config: EngineConfig, loaded, requests, mode: str) -> dict:
    figures = run_kvstrata(config, loaded, requests, prepare=keep_every_block if mode == "keep" else None)
    print(f"{mode}: {figures['decode_tokens_per_s']} output tokens/s, {figures['most_sequences_in_a_step']} "
          f"sequences at most, {figures['preemptions']} preemptions", file=sys.stderr, flush=True)
    return {"mode": mode, **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1280)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--full-batch", type=int, default=2, help="requests the budget holds whole at once")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    request_tokens = args.prompt_len + args.output_len
    reference = LLMEngine(EngineConfig(threads=args.threads, kv_cache_memory="256MiB", max_model_len=request_tokens))
    bytes_per_token = engine_storage_layout(reference, torch.float32, "fp32").bytes_per_token
    budget = int(args.full_batch * request_tokens * bytes_per_token)
    config = EngineConfig(threads=args.threads, kv_cache_memory=budget, max_model_len=request_tokens,
                          enable_prefix_caching=False)  # prompts of one text may share blocks by chance
    loaded = with_window(reference.loaded, args.window)
    requests = sample_requests(reference.tokenizer, args.requests, parse_length(str(args.prompt_len), "prompt-len"),
                               parse_length(str(args.output_len), "output-len"), EMMA, args.seed)
    del reference
    order = [mode for pair in range(args.pairs) for mode in (("keep", "give-back") if pair % 2 == 0
                                                             else ("give-back", "keep"))]
    runs = [run(config, loaded, requests, mode) for mode in order]
    pairs = [(runs[i], runs[i + 1]) for i in range(0, len(runs), 2)]
    ratios = [sig(next(r for r in pair if r["mode"] == "give-back")["decode_tokens_per_s"]
                  / next(r for r in pair if r["mode"] == "keep")["decode_tokens_per_s"]) for pair in pairs]
    print(json.dumps({
        "benchmark": "sliding_window_capacity",
        "machine": machine_info(),
        "model": loaded.name,
        "workload": {"window": args.window, "requests": args.requests, "prompt_len": args.prompt_len,
                     "output_len": args.output_len, "kv_budget_bytes": budget, "full_batch": args.full_batch,
                     "text": EMMA.name, "seed": args.seed, "scheduler": config.scheduler},
        "config": dataclasses.asdict(config),
        "output_tokens_per_s_ratio_give_back_to_keep": ratios,
        "runs": runs,
    }, indent=2))


if __name__ == "__main__":
    main()
