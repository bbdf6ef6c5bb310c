"""Total throughput of the sarathi scheduler per chunk size on one offline workload (greedy).

    .venv/bin/python benchmarks/chunk_size_sweep.py --requests 32 --prompt-len 256 --output-len 128

Prints one JSON document; `best_chunk_size` is the engine's default when measured on the default model.
"""

from __future__ import annotations

import argparse
import json
import time

from kvstrata import LLM, SamplingParams
from kvstrata.bench.report import machine_info
from kvstrata.bench.workload import prompts_from_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--chunk-sizes", default="64,128,256,512,1024")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()

    llm = LLM(args.model, kv_cache_memory="1GiB")
    prompts = prompts_from_text(llm.tokenizer, args.requests, args.prompt_len)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    results = []
    for chunk in (int(c) for c in args.chunk_sizes.split(",")):
        engine = LLM(args.model, kv_cache_memory="1GiB", chunk_size=chunk, enable_prefix_caching=False)
        engine.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
        start = time.perf_counter()
        engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = args.requests * (args.prompt_len + args.output_len)
        results.append({"chunk_size": chunk, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1)})
    best = max(results, key=lambda r: r["tokens_per_s"])
    print(json.dumps({
        "benchmark": "chunk_size_sweep",
        "machine": machine_info(),
        "model": args.model or "SmolLM2-135M-Instruct (default)",
        "workload": vars(args),
        "results": results,
        "best_chunk_size": best["chunk_size"],
        "ratio_best_to_worst": round(best["tokens_per_s"] / min(r["tokens_per_s"] for r in results), 3),
    }, indent=2))


if __name__ == "__main__":
    main()
