"""Streaming stored contexts over an emulated link (docs/BENCHMARKS.md, "Streaming with adaptation").

    python -m benchmarks.kv_store_stream > benchmarks/results/kv_store_stream.json

Contexts of 4,000 tokens (Emma, Persuasion, the Python tutorial, KJV Acts), plus a question each, are written
to a real Redis server (loopback, started here) in the `levels` form by one engine. One reading engine then
asks them again, one request at a time, with the Redis link emulated by a token bucket over each bandwidth trace
(`--kv-store-link-gbps`: the bytes travel for real, then each read waits for the emulated link; the trace
restarts at every load; the two random traces redraw the rate every 0.2 s, as the paper's per-chunk draws).
Per trace, every fixed level (float16 is the raw float16 baseline) and adaptation (`--kv-store-level auto
--ttft-slo S`) at each objective are policies, each with a link of its own (its own estimates and counters) on
the same engine: request by request, every policy asks the same prompt, in a seeded shuffled order, the device
pool's cached prefixes forgotten before each, so that the policies share weights, pool, memory and the machine's
drifts. Recompute (no store) is measured once on that engine, since no link is involved. Reported: TTFT of every
request (from its arrival: lookup, fetch, decode and the prefill of what was not loaded), the share of requests
over each objective, the chunks per level and, for adaptation, the chunks read below the level the throughput of
their own read allowed and those finished at another level after the link slowed during their read.

Each policy first loads one context that is not scored, so that its estimates of prefill speed, throughput
and decode time start from a measurement, as they would in a server that has been running.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from kvstrata.bench.redis_server import RedisServer
from kvstrata.bench.report import machine_info
from kvstrata.config import EngineConfig
from kvstrata.data import EMMA
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.kv.store.adaptation import quality_rank
from kvstrata.kv.store.forms import STREAMED_LEVELS

DATA = Path(__file__).parent / "data"
TEXTS = {"emma": EMMA, "persuasion": DATA / "persuasion.txt", "python_tutorial": DATA / "python_tutorial.txt",
         "kjv_acts": DATA / "kjv_acts.txt"}
CONTEXT_TOKENS = 4000
QUESTION = "\n\nQuestion: What is the passage above about?\nAnswer:"


def random_trace(seed: int, segments: int = 40, seconds: float = 0.2) -> str:
    """The paper's adaptation runs (§7.4) draw each chunk's bandwidth from 0.1-10 Gbps: here the rate is drawn
    anew every `seconds` (about one chunk's load on this machine), log-uniform over 0.1-10 Gbps, seeded."""
    rng = random.Random(seed)
    rates = [f"{10 ** rng.uniform(-1, 1):.3g}" for _ in range(segments)]
    return ",".join(f"{rate}:{seconds}" for rate in rates[:-1]) + f",{rates[-1]}"


TRACES = {"steady_0.1gbps": "0.1", "steady_1gbps": "1", "steady_10gbps": "10", "drop_10_to_0.1gbps": "10:0.02,0.1",
          "random_a": random_trace(1), "random_b": random_trace(2)}


def engine(**options) -> LLMEngine:
    return LLMEngine(EngineConfig(threads=2, **options))


def ttft(engine: LLMEngine, token_ids: list[int]) -> float:
    """One request alone, one token, after the device pool forgot its cached prefixes; its time to first token
    from arrival."""
    engine.reset_prefix_cache()
    engine.add_request(token_ids, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                if output.error:
                    raise RuntimeError(output.error)
                return output.metrics.ttft
    raise RuntimeError("the request did not finish")


def prompts(tokenizer: LLMEngine, per_text: int) -> list[list[int]]:
    """`per_text` contexts from each text (apart), each with the question; the first one is the warm-up."""
    question = tokenizer.tokenize(QUESTION)
    result = []
    for path in TEXTS.values():
        text = path.read_text(encoding="utf-8")
        for index in range(per_text):
            start = 20_000 + index * (len(text) - 100_000) // per_text
            result.append(tokenizer.tokenize(text[start : start + 40_000])[:CONTEXT_TOKENS] + question)
    return result


def with_link(reader: LLMEngine, link, token_ids: list[int]) -> float:
    """`ttft` through `link` (None: recompute)."""
    reader.use_kv_store_link(link)
    return ttft(reader, token_ids)


def run_policies(reader: LLMEngine, trace: str, policies: dict[str, dict], asked: list[list[int]],
                 warm_up: list[int], order: random.Random) -> dict[str, dict]:
    """Every policy (name: EngineConfig changes) on a link of its own over `trace`, request by request."""
    links = {name: reader.make_kv_store_link(kv_store_link_gbps=trace, **changes) for name, changes in policies.items()}
    for link in links.values():
        with_link(reader, link, warm_up)
    before = {name: (dict(link.stats.chunks_by_option), link.stats.chunks_below_allowed, link.stats.chunks_switched)
              for name, link in links.items()}
    times = {name: [] for name in links}
    for prompt in asked:
        for name in order.sample(list(links), len(links)):
            times[name].append(with_link(reader, links[name], prompt))
    reader.use_kv_store_link(None)
    rows = {}
    for name, link in links.items():
        link.close()
        by_option, below, switched = before[name]
        chunks = {level: count - by_option.get(level, 0) for level, count in link.stats.chunks_by_option.items()}
        chunks = {level: count for level, count in chunks.items() if count}
        total = sum(chunks.values())
        rows[name] = {"ttft_s": times[name], "chunks_by_option": chunks,
                      "mean_quality_rank": sum(quality_rank(o) * n for o, n in chunks.items()) / max(total, 1),
                      "chunks_below_allowed": link.stats.chunks_below_allowed - below,
                      "chunks_switched": link.stats.chunks_switched - switched,
                      "last_throughput_mbps": (link.estimate.bytes_per_second or 0) * 8 / 1e6,
                      "plan_errors": list(link.estimate.plan_errors),  # the last loads' actual / predicted seconds
                      "overshoots_s": list(link.estimate.overshoots)}  # seconds past their last choice's stretched plan
    return rows


def miss_share(times: list[float], slo: float) -> float:
    return sum(t > slo for t in times) / len(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slos", default="1.0,1.25,1.5,2.0,2.5", help="time-to-first-token objectives, seconds")
    parser.add_argument("--per-text", type=int, default=2, help="contexts per text")
    parser.add_argument("--traces", default=",".join(TRACES), help=f"of {', '.join(TRACES)}")
    parser.add_argument("--seed", type=int, default=0, help="the policies' order for each request")
    args = parser.parse_args()
    slos = [float(s) for s in args.slos.split(",")]
    traces = {name: TRACES[name] for name in args.traces.split(",")}
    policies = {level: {"kv_store_level": level, "ttft_slo": None} for level in STREAMED_LEVELS}
    policies |= {f"adaptive@{slo}s": {"kv_store_level": "auto", "ttft_slo": slo} for slo in slos}
    order = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as scratch:
        redis = RedisServer(Path(scratch)).start()
        try:
            writer = engine(kv_store=redis.url, kv_store_format="levels")
            all_prompts = prompts(writer, args.per_text)
            warm_up, asked = all_prompts[0], all_prompts[1:]
            for prompt in all_prompts:
                ttft(writer, prompt)
            writer.close()  # waits for its writes
            reader = engine(kv_store=redis.url, kv_store_format="levels")
            reader.kv_store.close()  # its own link goes unused: each policy gets one (run_policies), recompute none
            with_link(reader, None, warm_up)
            recompute = [with_link(reader, None, prompt) for prompt in asked]
            report = {"machine": machine_info(), "link": "emulated: token bucket over each trace, bytes over loopback",
                      "context_tokens": CONTEXT_TOKENS, "requests_per_run": len(asked), "slos_s": slos,
                      "policy_order": f"shuffled per request, random.Random({args.seed})",
                      "recompute": {"ttft_s": recompute, "miss_share": {str(s): miss_share(recompute, s) for s in slos}},
                      "traces": {}}
            for name, trace in traces.items():
                runs = run_policies(reader, trace, policies, asked, warm_up, order)
                for policy, row in runs.items():
                    row["miss_share"] = {str(s): miss_share(row["ttft_s"], s) for s in slos
                                         if policy in STREAMED_LEVELS or policy == f"adaptive@{s}s"}
                    print(name, policy, json.dumps(row), file=sys.stderr, flush=True)
                report["traces"][name] = {"trace_gbps": trace, "runs": runs}
            report["summary"] = summary(report, slos)
        finally:
            redis.stop()
    print(json.dumps(report, indent=2))


def summary(report: dict, slos: list[float]) -> dict:
    """Per objective: the share of all requests (every trace) over it, per policy."""
    result = {}
    for slo in slos:
        key = str(slo)
        policies = {level: [] for level in STREAMED_LEVELS}
        policies["adaptive"] = []
        for trace in report["traces"].values():
            for level in STREAMED_LEVELS:
                policies[level].append(trace["runs"][level]["miss_share"][key])
            policies["adaptive"].append(trace["runs"][f"adaptive@{slo}s"]["miss_share"][key])
        row = {policy: sum(shares) / len(shares) for policy, shares in policies.items()}
        row["recompute"] = report["recompute"]["miss_share"][key]
        row["adaptive_chunks_below_allowed"] = {name: trace["runs"][f"adaptive@{slo}s"]["chunks_below_allowed"]
                                                for name, trace in report["traces"].items()}
        result[key] = row
    return result


if __name__ == "__main__":
    main()
