"""`kvstrata bench lpm`: what `--scheduling-policy lpm` (SGLang's longest prefix match) does where many requests
share a few long prefixes and the KV pool holds only some of them.

--documents passages of --document-tokens (consecutive windows of the text) are each asked --questions questions
(each its own --question-tokens of the text after the passages), and exactly --max-tokens greedy tokens are
generated per request. All requests are sent at once in a shuffled order (--seed): a batch job, or a burst of users
over a set of documents. The KV budget holds --documents-held requests at full length, so the pool cannot keep every
passage. --cold more requests over passages of their own are spread through the order, and with --arrive-every K
request i is sent before step i x K instead (a stream that may starve the cold ones under lpm). The same workload
runs under fcfs (what vLLM does), lpm, and lpm with --lpm-aging-tokens-per-s where that is given, in turn for
--rounds rounds, on one set of weights. Reported per run: seconds, output tokens/s, prompt tokens computed (prefill
work, recomputation after preemption included) and the share of prompt tokens read from the prefix cache, time to
first token percentiles, end-to-end latency, preemptions (and the cold requests' time to first token); how many
requests got the same greedy output as under fcfs in the last round; and fcfs's figures over each lpm configuration's (above 1: what
it saves; tokens/s: the other way round).

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
from kvstrata.bench.workload import kv_budget_for, medians, read_text, take_turns, warm_up
from kvstrata.cli.engine_args import engine_config_from_args
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.errors import KvstrataError


def run_lpm_bench(args: argparse.Namespace) -> None:
    for flag, least in (("documents", 1), ("document_tokens", 1), ("questions", 1), ("question_tokens", 1),
                        ("max_tokens", 1), ("documents_held", 1), ("rounds", 1), ("cold", 0), ("arrive_every", 0)):
        if getattr(args, flag) < least:
            raise KvstrataError(f"--{flag.replace('_', '-')} must be at least {least}, got {getattr(args, flag)}")
    aging = args.lpm_aging_tokens_per_s  # the third configuration's; the engine options' policy is each run's own
    base = engine_config_from_args(argparse.Namespace(**{**vars(args), "lpm_aging_tokens_per_s": 0.0}))
    probe = LLMEngine(base)
    workload = _workload(probe.tokenizer, args)
    request_tokens = args.document_tokens + args.question_tokens + args.max_tokens
    config = dataclasses.replace(base, kv_cache_memory=kv_budget_for(probe, args.documents_held, request_tokens),
                                 max_model_len=request_tokens + 1)
    policies = {"fcfs": ("fcfs", 0.0), "lpm": ("lpm", 0.0)}
    if aging:
        policies["lpm_aging"] = ("lpm", float(aging))
    engines = {name: LLMEngine(dataclasses.replace(config, scheduling_policy=policy, lpm_aging_tokens_per_s=rate),
                               loaded=probe.loaded)
               for name, (policy, rate) in policies.items()}
    del probe
    warm_up(engines.values(), workload.prompts[0][: args.question_tokens])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    results = take_turns(engines, args.rounds, lambda engine: _run(engine, workload, params, args.arrive_every))
    runs = {name: [figures for figures, _ in one] for name, one in results.items()}
    outputs = {name: one[-1][1] for name, one in results.items()}  # the last round's
    exact = medians(runs)
    rounded = {name: {key: sig(value) for key, value in one.items()} for name, one in exact.items()}
    info = engine_info(engines["lpm"])
    # the runs take turns: each configuration's policy and aging
    info["config"]["scheduling_policy"] = {name: policy for name, (policy, _) in policies.items()}
    info["config"]["lpm_aging_tokens_per_s"] = {name: rate for name, (_, rate) in policies.items()}
    ratios = ["seconds", "computed_prompt_tokens", "p50_ttft_s", "p90_ttft_s", "p99_ttft_s", "max_ttft_s", "mean_e2e_s"]
    if args.cold:
        ratios += ["p50_cold_ttft_s", "max_cold_ttft_s"]
    emit({
        "benchmark": "lpm",
        "machine": machine_info(),
        **info,
        "workload": {"text": str(args.text), "documents": args.documents, "document_tokens": args.document_tokens,
                     "questions": args.questions, "question_tokens": args.question_tokens, "cold": args.cold,
                     "arrive_every": args.arrive_every, "max_tokens": args.max_tokens,
                     "documents_held": args.documents_held, "seed": args.seed, "rounds": args.rounds,
                     "kv_cache_memory": config.kv_cache_memory, "threads": torch.get_num_threads()},
        "runs": runs,
        "medians": rounded,
        "outputs_compared": {name: _compare(outputs["fcfs"], outputs[name]) for name in engines if name != "fcfs"},
        # fcfs's over each lpm configuration's (above 1: what it saves); tokens/s the other way round
        "fcfs_over": {name: {key: sig(exact["fcfs"][key] / one[key]) if one[key] else None for key in ratios}
                      for name, one in exact.items() if name != "fcfs"},
        "tokens_per_s_over_fcfs": {name: sig(one["output_tokens_per_s"] / exact["fcfs"]["output_tokens_per_s"])
                                   for name, one in exact.items() if name != "fcfs"},
    }, args.json)


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]  # in the order they are sent
    cold: set[int]  # the indexes of those over a passage of their own


def _workload(tokenizer, args: argparse.Namespace) -> Workload:
    """The passages' questions in a shuffled order, with the --cold requests (a passage and a question each, shared
    with no other) spread evenly through it. The text gives the passages, then the questions, one after another."""
    ids = tokenizer.encode(read_text(args.text))
    size, asked = args.document_tokens, args.documents * args.questions + args.cold
    passages = args.documents + args.cold
    needed = passages * size + asked * args.question_tokens
    if len(ids) < needed:
        raise KvstrataError(f"{args.text} has {len(ids)} tokens, fewer than the {needed} of {passages} passages of "
                            f"{size} and {asked} questions of {args.question_tokens}")
    passage = [ids[i * size : (i + 1) * size] for i in range(passages)]
    start = passages * size
    question = [ids[start + i * args.question_tokens : start + (i + 1) * args.question_tokens] for i in range(asked)]
    pairs = [(d, q) for d in range(args.documents) for q in range(args.questions)]
    random.Random(args.seed).shuffle(pairs)
    hot = iter([passage[d] + question[d * args.questions + q] for d, q in pairs])
    own = iter([passage[args.documents + i] + question[len(pairs) + i] for i in range(args.cold)])
    total = len(pairs) + args.cold
    cold = {int((i + 0.5) * total / args.cold) for i in range(args.cold)} if args.cold else set()
    return Workload([next(own) if i in cold else next(hot) for i in range(total)], cold)


def _run(engine: LLMEngine, workload: Workload, params: SamplingParams,
         arrive_every: int) -> tuple[dict, list[list[int]]]:
    """Send request i before step i x `arrive_every` (all at once where 0; an idle engine's empty steps count) and
    run them to their end; the run's figures, and each request's output tokens."""
    engine.reset_prefix_cache()  # nothing reused from the run before
    engine.step_stats.clear()
    start = time.perf_counter()
    ids, finished, step = [], {}, 0
    while len(ids) < len(workload.prompts) or engine.has_unfinished_requests():
        while len(ids) < len(workload.prompts) and len(ids) * arrive_every <= step:
            ids.append(engine.add_request(workload.prompts[len(ids)], params))
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
        step += 1
    seconds = time.perf_counter() - start
    done = [finished[request_id] for request_id in ids]
    prompt_tokens = sum(len(prompt) for prompt in workload.prompts)
    ttft = [out.metrics.ttft for out in done]
    figures = {
        "seconds": seconds,
        "output_tokens_per_s": sum(out.metrics.num_output_tokens for out in done) / seconds,
        # prompt tokens run through the model: the first prefill's and every one after a preemption
        "computed_prompt_tokens": sum(s.prefill_tokens for s in engine.step_stats),
        # prompt tokens read from the prefix cache at each request's first admission, over all prompt tokens
        "prefix_hit_share": sum(out.num_cached_tokens for out in done) / prompt_tokens,
        **summarize(ttft, "ttft_s"),
        "max_ttft_s": max(ttft),
        "mean_e2e_s": statistics.mean(out.metrics.e2e for out in done),
        "preemptions": sum(s.num_preempted for s in engine.step_stats),
    }
    if workload.cold:
        cold = [ttft[i] for i in sorted(workload.cold)]
        figures.update({"p50_cold_ttft_s": statistics.median(cold), "max_cold_ttft_s": max(cold)})
    return figures, [list(out.token_ids) for out in done]


def _compare(first: list[list[int]], second: list[list[int]]) -> dict:
    """How many requests got the same output tokens, and where each of the others first differs."""
    differ = [next((i for i, (a, b) in enumerate(zip(one, other)) if a != b), min(len(one), len(other)))
              for one, other in zip(first, second) if one != other]
    return {"requests": len(first), "same": len(first) - len(differ), "first_difference_at": sorted(differ)}
