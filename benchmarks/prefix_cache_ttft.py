"""Time to first token of a request whose 1,000-token prefix an earlier request already prefilled.

    .venv/bin/python -m benchmarks.prefix_cache_ttft

Runs request A (prefix + question 1), then request B (prefix + question 2) on the same engine,
and B again on an engine with prefix caching off, all greedy. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json

from kvstrata import LLM, SamplingParams
from kvstrata.bench.report import machine_info
from kvstrata.bench.workload import prompts_from_text

QUESTIONS = (" Who is Emma?", " Who is Mr. Knightley?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    params = SamplingParams(max_tokens=8, temperature=0.0)
    cached, uncached = LLM(), LLM(enable_prefix_caching=False)
    runs = []
    for repeat in range(args.repeats):
        # A different prefix each repeat, so request A never hits the cache.
        prefix = prompts_from_text(cached.tokenizer, args.repeats, args.prefix_len)[repeat]
        first, second = (prefix + cached.tokenizer.encode(q) for q in QUESTIONS)
        a = cached.generate([first], params)[0]
        b = cached.generate([second], params)[0]
        cold = uncached.generate([second], params)[0]
        assert b.token_ids == cold.token_ids, "the cached prefix changed the output"
        runs.append({
            "ttft_first_s": round(a.metrics.ttft, 4),
            "ttft_second_cached_s": round(b.metrics.ttft, 4),
            "ttft_second_uncached_s": round(cold.metrics.ttft, 4),
            "prefix_hit_tokens": b.num_cached_tokens,
        })

    def best(key: str) -> float:  # fastest of the repeats
        return min(r[key] for r in runs)

    print(json.dumps({
        "benchmark": "prefix_cache_ttft",
        "machine": machine_info(),
        "model": "SmolLM2-135M-Instruct (default)",
        "workload": vars(args),
        "runs": runs,
        "speedup_cached_vs_uncached": round(best("ttft_second_uncached_s") / best("ttft_second_cached_s"), 2),
    }, indent=2))


if __name__ == "__main__":
    main()
