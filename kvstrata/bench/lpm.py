"""`kvstrata bench lpm`: what `--scheduling-policy lpm` (SGLang's longest prefix match) does where many requests
share a few long prefixes and the KV pool holds only some of them.

--documents passages of --document-tokens (consecutive windows of the text) are each asked --questions questions
(each its own --question-tokens, the windows after the passages), and exactly --max-tokens greedy tokens are
generated per request. All requests are sent at once in a shuffled order (--seed): a batch job, or a burst of users
over a set of documents. The KV budget holds --documents-held requests at full length, so the pool cannot keep every
passage. The same workload runs under fcfs (what vLLM does) and under lpm, alternately for --rounds rounds, on one set
of weights. Reported per run: seconds, output tokens/s, prompt tokens computed (prefill work, recomputation after
preemption included) and the share of prompt tokens read from the prefix cache, time to first token percentiles,
end-to-end latency, preemptions; how many requests got the same greedy output under both policies; and fcfs over lpm (above 1: what
lpm saves; tokens/s: lpm over fcfs).

The outputs are compared rather than required equal: a step's products sum in an order set by how many rows it has,
so a request batched with others, or reading its prefix from the cache rather than computing it, can come out an ulp
apart and, where two tokens are nearly tied, continue otherwise (on the tiny float32 test model they are equal).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from kvstrata.bench.report import emit, engine_info, machine_info, sig
from kvstrata.bench.stats import summarize
from kvstrata.bench.workload import kv_budget_for, prompts_from_text
from kvstrata.cli.engine_args import engine_config_from_args
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.errors import KvstrataError

POLICIES = ("fcfs", "lpm")


def run_lpm_bench(args: argparse.Namespace) -> None:
    if min(args.documents, args.document_tokens, args.questions, args.question_tokens, args.max_tokens,
           args.documents_held, args.rounds) < 1:
        raise KvstrataError("--documents, --document-tokens, --questions, --question-tokens, --max-tokens, "
                            "--documents-held and --rounds must be at least 1")
    base = engine_config_from_args(args)
    probe = LLMEngine(base)
    windows = prompts_from_text(probe.tokenizer, args.documents * (1 + args.questions), args.document_tokens,
                                args.text)
    documents = windows[: args.documents]
    questions = [window[: args.question_tokens] for window in windows[args.documents :]]
    pairs = [(d, q) for d in range(args.documents) for q in range(args.questions)]
    random.Random(args.seed).shuffle(pairs)
    prompts = [documents[d] + questions[d * args.questions + q] for d, q in pairs]
    request_tokens = args.document_tokens + args.question_tokens + args.max_tokens
    config = dataclasses.replace(base, kv_cache_memory=kv_budget_for(probe, args.documents_held, request_tokens),
                                 max_model_len=request_tokens + 1)
    engines = {policy: LLMEngine(dataclasses.replace(config, scheduling_policy=policy), loaded=probe.loaded)
               for policy in POLICIES}
    del probe
    for engine in engines.values():  # one-time costs (the compiled decode) before anything is timed
        engine.add_request(questions[0], SamplingParams(max_tokens=2, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    runs = {policy: [] for policy in POLICIES}
    outputs = {}
    for _ in range(args.rounds):
        for policy, engine in engines.items():
            figures, outputs[policy] = _run(engine, prompts, params)
            runs[policy].append(figures)
    medians = {policy: {key: sig(statistics.median(run[key] for run in one)) for key in one[0]}
               for policy, one in runs.items()}
    fcfs, lpm = medians["fcfs"], medians["lpm"]
    info = engine_info(engines["lpm"])
    info["config"]["scheduling_policy"] = list(POLICIES)  # the runs take turns
    emit({
        "benchmark": "lpm",
        "machine": machine_info(),
        **info,
        "workload": {"text": str(args.text), "documents": args.documents, "document_tokens": args.document_tokens,
                     "questions": args.questions, "question_tokens": args.question_tokens,
                     "max_tokens": args.max_tokens, "documents_held": args.documents_held, "seed": args.seed,
                     "rounds": args.rounds, "kv_cache_memory": config.kv_cache_memory,
                     "threads": torch.get_num_threads()},
        "runs": runs,
        "medians": medians,
        "outputs_compared": _compare(outputs["fcfs"], outputs["lpm"]),
        "fcfs_over_lpm": {key: sig(fcfs[key] / lpm[key]) if lpm[key] else None
                          for key in ("seconds", "computed_prompt_tokens", "p50_ttft_s", "p90_ttft_s", "p99_ttft_s",
                                      "mean_e2e_s")},
        "lpm_over_fcfs_tokens_per_s": sig(lpm["output_tokens_per_s"] / fcfs["output_tokens_per_s"]),
    }, args.json)


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[dict, list[list[int]]]:
    """Send every request at once and run them to their end; the run's figures, and each request's output tokens."""
    engine.reset_prefix_cache()  # nothing reused from the run before
    engine.step_stats.clear()
    start = time.perf_counter()
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    seconds = time.perf_counter() - start
    done = [finished[request_id] for request_id in ids]
    prompt_tokens = sum(len(prompt) for prompt in prompts)
    return {
        "seconds": seconds,
        "output_tokens_per_s": sum(out.metrics.num_output_tokens for out in done) / seconds,
        # prompt tokens run through the model: the first prefill's and every one after a preemption
        "computed_prompt_tokens": sum(s.prefill_tokens for s in engine.step_stats),
        # prompt tokens read from the prefix cache at each request's first admission, over all prompt tokens
        "prefix_hit_share": sum(out.num_cached_tokens for out in done) / prompt_tokens,
        **summarize([out.metrics.ttft for out in done], "ttft_s"),
        "mean_e2e_s": statistics.mean(out.metrics.e2e for out in done),
        "preemptions": sum(s.num_preempted for s in engine.step_stats),
    }, [list(out.token_ids) for out in done]


def _compare(first: list[list[int]], second: list[list[int]]) -> dict:
    """How many requests got the same output tokens, and where each of the others first differs."""
    differ = [next((i for i, (a, b) in enumerate(zip(one, other)) if a != b), min(len(one), len(other)))
              for one, other in zip(first, second) if one != other]
    return {"requests": len(first), "same": len(first) - len(differ), "first_difference_at": sorted(differ)}
