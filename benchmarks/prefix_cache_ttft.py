"""Time to first token of requests whose 1,000-token prefix an earlier request already prefilled, or that
arrive together with one prefix.

    .venv/bin/python -m benchmarks.prefix_cache_ttft

Runs request A (prefix + question 1), then request B (prefix + question 2) on the same engine,
and B again on an engine with prefix caching off, all greedy. Then `--together` requests (another prefix,
each with its own question) given to each engine at once: the prefix-caching engine computes their shared
prefix once, the other once per request. Prints one JSON document.

Greedy outputs with and without the cache are compared: under `--weights fp32` they must be equal (the script
asserts it); under the default `auto` the tokens after a cache hit go through few-row products with int8
activations, so a near tie may part them (docs/DESIGN.md, "weights as shipped"), and the JSON says whether
they did.
"""

from __future__ import annotations

import argparse
import json

from kvstrata import LLM, SamplingParams
from kvstrata.bench.report import machine_info
from kvstrata.bench.workload import prompts_from_text

QUESTIONS = (" Who is Emma?", " Who is Mr. Knightley?", " Who is Harriet?", " Where does Emma live?")


def together(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[dict, list[list[int]]]:
    """Every prompt given at once: mean and last time to first token, prompt tokens the engine computed."""
    llm.engine.step_stats.clear()
    outputs = llm.generate(prompts, params)
    ttfts = [o.metrics.ttft for o in outputs]
    return {
        "mean_ttft_s": round(sum(ttfts) / len(ttfts), 4),
        "last_ttft_s": round(max(ttfts), 4),
        "prefill_tokens": sum(s.prefill_tokens for s in llm.engine.step_stats),
    }, [o.token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--together", type=int, default=4, choices=range(1, len(QUESTIONS) + 1),
                        help="requests with one prefix given at once")
    parser.add_argument("--weights", default="auto", choices=("auto", "fp32"))
    args = parser.parse_args()

    params = SamplingParams(max_tokens=8, temperature=0.0)
    cached, uncached = LLM(weights=args.weights), LLM(weights=args.weights, enable_prefix_caching=False)
    exact = args.weights == "fp32"
    runs = []
    for repeat in range(args.repeats):
        # A different prefix each repeat, so request A never hits the cache.
        prefix, shared = prompts_from_text(cached.tokenizer, 2 * args.repeats, args.prefix_len)[2 * repeat :][:2]
        first, second = (prefix + cached.tokenizer.encode(q) for q in QUESTIONS[:2])
        a = cached.generate([first], params)[0]
        b = cached.generate([second], params)[0]
        cold = uncached.generate([second], params)[0]
        assert b.token_ids == cold.token_ids or not exact, "the cached prefix changed the output"
        prompts = [shared + cached.tokenizer.encode(q) for q in QUESTIONS[: args.together]]
        sharing, shared_tokens = together(cached, prompts, params)
        apart, apart_tokens = together(uncached, prompts, params)
        assert shared_tokens == apart_tokens or not exact, "computing the prefix once changed the output"
        runs.append({
            "ttft_first_s": round(a.metrics.ttft, 4),
            "ttft_second_cached_s": round(b.metrics.ttft, 4),
            "ttft_second_uncached_s": round(cold.metrics.ttft, 4),
            "prefix_hit_tokens": b.num_cached_tokens,
            "second_same_greedy_output": b.token_ids == cold.token_ids,
            "together_cached": sharing,
            "together_uncached": apart,
            "together_same_greedy_outputs": sum(x == y for x, y in zip(shared_tokens, apart_tokens)),
        })

    def best(key: str, part: str | None = None) -> float:  # fastest of the repeats
        return min(r[part][key] if part else r[key] for r in runs)

    print(json.dumps({
        "benchmark": "prefix_cache_ttft",
        "machine": machine_info(),
        "model": "SmolLM2-135M-Instruct (default)",
        "workload": vars(args),
        "runs": runs,
        "speedup_cached_vs_uncached": round(best("ttft_second_uncached_s") / best("ttft_second_cached_s"), 2),
        "together_mean_ttft_speedup_cached_vs_uncached": round(
            best("mean_ttft_s", "together_uncached") / best("mean_ttft_s", "together_cached"), 2),
    }, indent=2))


if __name__ == "__main__":
    main()
