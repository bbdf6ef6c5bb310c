"""`kvstrata bench priority`: what `--scheduling-policy priority` does for urgent requests that arrive while a
batch job holds the KV cache, and what it costs the batch job.

--background requests (--background-prompt-tokens windows of the text, exactly --background-max-tokens greedy tokens
each, priority 1) are sent at once to an engine whose KV budget holds --background-running of them at full length, so
the rest wait. Then --urgent requests (shorter: --urgent-prompt-tokens and --urgent-max-tokens, priority 0) arrive,
the first before step --urgent-after and one more every --urgent-every steps after it. The same workload runs under
fcfs (every priority 0: fcfs refuses others, and ignores them anyway) and under priority, alternately for --rounds
rounds, on one set of weights. Reported per run: the urgent requests' time to first token and end-to-end latency, the
background requests' end-to-end latency, output tokens/s over the whole run, preemptions and the prompt tokens
computed again after them; and fcfs's over priority's medians, so a figure above 1 is what priority saves (or, for
tokens/s, priority's over fcfs's: what it costs).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from kvstrata.bench.report import emit, engine_info, machine_info, sig
from kvstrata.bench.workload import kv_budget_for, medians, prompts_from_text, take_turns, warm_up
from kvstrata.cli.engine_args import engine_config_from_args
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.outputs import RequestOutput
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.errors import KvstrataError

BACKGROUND_PRIORITY, URGENT_PRIORITY = 1, 0
POLICIES = ("fcfs", "priority")  # the policies compared


@dataclasses.dataclass
class Workload:
    background: list[list[int]]
    background_max_tokens: int
    urgent: list[list[int]]
    urgent_max_tokens: int
    urgent_after: int
    urgent_every: int

    def arrival_steps(self) -> list[int]:
        return [self.urgent_after + i * self.urgent_every for i in range(len(self.urgent))]


def run_priority_bench(args: argparse.Namespace) -> None:
    if min(args.background, args.background_running, args.background_prompt_tokens, args.background_max_tokens,
           args.urgent, args.urgent_prompt_tokens, args.urgent_max_tokens, args.rounds) < 1:
        raise KvstrataError("--background, --background-running, --urgent, their --*-tokens and --rounds must be at "
                            "least 1")
    if args.urgent_after < 0 or args.urgent_every < 1:
        raise KvstrataError("--urgent-after must be at least 0 and --urgent-every at least 1")
    base = engine_config_from_args(args)
    probe = LLMEngine(base)
    prompts = prompts_from_text(probe.tokenizer, args.background + args.urgent,
                                max(args.background_prompt_tokens, args.urgent_prompt_tokens), args.text)
    workload = Workload([p[: args.background_prompt_tokens] for p in prompts[: args.background]],
                        args.background_max_tokens, [p[: args.urgent_prompt_tokens] for p in prompts[args.background:]],
                        args.urgent_max_tokens, args.urgent_after, args.urgent_every)
    config = _capped_config(probe, base, args)
    engines = {policy: LLMEngine(dataclasses.replace(config, scheduling_policy=policy), loaded=probe.loaded)
               for policy in POLICIES}
    del probe
    warm_up(engines.values(), workload.urgent[0])
    runs = take_turns(engines, args.rounds, lambda engine: _run(engine, workload))
    rounded = {policy: {key: sig(value) for key, value in one.items()} for policy, one in medians(runs).items()}
    fcfs, priority = rounded["fcfs"], rounded["priority"]
    info = engine_info(engines["priority"])
    info["config"]["scheduling_policy"] = list(POLICIES)  # the runs take turns
    emit({
        "benchmark": "priority",
        "machine": machine_info(),
        **info,
        "workload": {"background": args.background, "background_running": args.background_running,
                     "background_prompt_tokens": args.background_prompt_tokens,
                     "background_max_tokens": args.background_max_tokens, "urgent": args.urgent,
                     "urgent_prompt_tokens": args.urgent_prompt_tokens, "urgent_max_tokens": args.urgent_max_tokens,
                     "urgent_arrival_steps": workload.arrival_steps(), "rounds": args.rounds,
                     "kv_cache_memory": config.kv_cache_memory, "threads": torch.get_num_threads()},
        "runs": runs,
        "medians": rounded,
        "fcfs_over_priority": {
            key: sig(fcfs[key] / priority[key])
            for key in ("urgent_ttft_steps_mean", "urgent_ttft_s_mean", "urgent_ttft_s_max", "urgent_e2e_s_mean",
                        "background_e2e_s_mean")
        },
        "priority_over_fcfs_tokens_per_s": sig(priority["output_tokens_per_s"] / fcfs["output_tokens_per_s"]),
    }, args.json)


def _capped_config(probe: LLMEngine, base, args: argparse.Namespace):
    """The engine options with a KV budget of exactly --background-running background requests' blocks (and a
    context that fits the longer kind of request)."""
    longest = max(args.background_prompt_tokens + args.background_max_tokens,
                  args.urgent_prompt_tokens + args.urgent_max_tokens)
    budget = kv_budget_for(probe, args.background_running, args.background_prompt_tokens + args.background_max_tokens)
    return dataclasses.replace(base, kv_cache_memory=budget, max_model_len=longest + 1)


def _run(engine: LLMEngine, workload: Workload) -> dict:
    """Send the background requests, step, and send each urgent request before its step; the run's figures."""
    engine.reset_prefix_cache()  # nothing reused from the run before
    engine.step_stats.clear()
    prioritized = engine.config.scheduling_policy == "priority"

    def params(max_tokens: int, priority: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                              priority=priority if prioritized else 0)

    background = [engine.add_request(prompt, params(workload.background_max_tokens, BACKGROUND_PRIORITY))
                  for prompt in workload.background]
    arrivals = dict(zip(workload.arrival_steps(), workload.urgent))
    urgent, first_step, finished = {}, {}, {}
    start = time.perf_counter()
    step = 0
    while engine.has_unfinished_requests() or step <= max(arrivals):  # every urgent request is sent
        if step in arrivals:
            urgent[engine.add_request(arrivals[step], params(workload.urgent_max_tokens, URGENT_PRIORITY))] = step
        for out in engine.step():
            first_step.setdefault(out.request_id, step)
            if out.finished:
                finished[out.request_id] = out
        step += 1
    seconds = time.perf_counter() - start
    urgent_outputs: list[RequestOutput] = [finished[request_id] for request_id in urgent]
    background_outputs = [finished[request_id] for request_id in background]
    prompt_tokens = sum(len(prompt) for prompt in workload.background + workload.urgent)
    output_tokens = sum(out.metrics.num_output_tokens for out in urgent_outputs + background_outputs)
    return {
        # steps from an urgent request's arrival to the one that gave its first token (1: the next step did)
        "urgent_ttft_steps_mean": statistics.mean(first_step[request_id] - arrival + 1
                                                  for request_id, arrival in urgent.items()),
        "urgent_ttft_s_mean": statistics.mean(out.metrics.ttft for out in urgent_outputs),
        "urgent_ttft_s_max": max(out.metrics.ttft for out in urgent_outputs),
        "urgent_e2e_s_mean": statistics.mean(out.metrics.e2e for out in urgent_outputs),
        "background_e2e_s_mean": statistics.mean(out.metrics.e2e for out in background_outputs),
        "seconds": seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "preemptions": sum(s.num_preempted for s in engine.step_stats),
        # prompt tokens computed again after a preemption (or read back from the prefix cache: not counted)
        "recomputed_tokens": sum(s.prefill_tokens for s in engine.step_stats) - prompt_tokens,
    }
