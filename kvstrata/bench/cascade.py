"""`kvstrata bench cascade`: decodes that share a long prefix (a system prompt, a document asked many questions),
with the prefix read once for all of them (`--cascade-min-tokens`, cascade attention) against once per sequence.

For each combination of --requests, --prefixes and --prefix-tokens: that many prefixes of that many tokens (windows
of the text, one after another), request i reading prefix i mod --prefixes and then a question of its own
(--question-tokens of the text after the prefixes); all requests are sent at once and generate exactly --max-tokens
greedy tokens. The prefix cache gives the requests over a prefix its blocks, so their decodes read it from the same
blocks. For each --kv-formats entry two engines on one set of weights take turns for --rounds rounds, each round in
the other order, after a warm-up on a workload of this kind: `cascade` (the engine options' --cascade-min-tokens, 512
by default) and `plain` (0: each sequence reads its own copy of the prefix).

Reported per run: seconds, decode tokens/s (decode steps only: no prompt tokens in them), output tokens/s and the
prefixes read once for all the decodes sharing them (layers x steps x groups); their medians; cascade's over
plain's; how many requests got the same greedy tokens from both in the last round (the prefix's sums run in another
order, so a near tie may continue otherwise, and a quantized KV format or int8 activation codes can turn a rounding
difference into another code); and how many got the same from plain in every round (what that comparison stands on).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from kvstrata.bench.flag_lists import positive_ints
from kvstrata.bench.report import emit, engine_info, machine_info, sig
from kvstrata.bench.workload import medians, read_text, run_together, take_turns
from kvstrata.cli.engine_args import engine_config_from_args
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.errors import KvstrataError
from kvstrata.kv.kernels import paged_decode


def run_cascade_bench(args: argparse.Namespace) -> None:
    requests, prefixes = positive_ints(args.requests, "requests"), positive_ints(args.prefixes, "prefixes")
    lengths = positive_ints(args.prefix_tokens, "prefix-tokens")
    # two tokens at least: the first comes from the prompt's step, the decodes time the rest
    for flag, least in (("question_tokens", 1), ("max_tokens", 2), ("rounds", 1)):
        if getattr(args, flag) < least:
            raise KvstrataError(f"--{flag.replace('_', '-')} must be at least {least}, got {getattr(args, flag)}")
    base = engine_config_from_args(args, varied=("kv_format",))
    if base.cascade_min_tokens == 0:
        raise KvstrataError("--cascade-min-tokens 0 turns cascade attention off; the benchmark compares it with that")
    formats = [name.strip() for name in args.kv_formats.split(",") if name.strip()]
    if not formats:
        raise KvstrataError(f"--kv-formats {args.kv_formats!r} names no format")
    loaded, cases = None, []
    for kv_format in formats:
        config = dataclasses.replace(base, kv_format=kv_format)
        engines = {"cascade": LLMEngine(config, loaded=loaded)}
        loaded = engines["cascade"].loaded
        engines["plain"] = LLMEngine(dataclasses.replace(config, cascade_min_tokens=0), loaded=loaded)
        ids = engines["plain"].tokenizer.encode(read_text(args.text))
        warm_up = _prompts(ids, 8, 1, base.cascade_min_tokens, args)  # the fewest sequences that read it once
        for engine in engines.values():  # the compiled kernels' and the matrix library's first calls
            run_together(engine, warm_up, [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)] * 8)
        for count in requests:
            for documents in prefixes:
                for prefix_tokens in lengths:
                    prompts = _prompts(ids, count, documents, prefix_tokens, args)
                    case = {"kv_format": kv_format, "requests": count, "prefixes": documents,
                            "prefix_tokens": prefix_tokens}
                    cases.append({**case, **_compare(engines, prompts, args)})
        info = engine_info(engines["cascade"])
    info["config"]["kv_format"] = formats
    emit({"benchmark": "cascade", "machine": machine_info(), **info,
          "workload": {"text": str(args.text), "question_tokens": args.question_tokens, "max_tokens": args.max_tokens,
                       "rounds": args.rounds, "threads": torch.get_num_threads()},
          "cases": cases}, args.json)


def _prompts(ids: list[int], count: int, documents: int, prefix_tokens: int,
             args: argparse.Namespace) -> list[list[int]]:
    """Request i: prefix i mod `documents` (the text's windows of prefix_tokens, one after another), then question i
    (the i-th window of --question-tokens after the prefixes)."""
    start, size = documents * prefix_tokens, args.question_tokens
    if len(ids) < start + count * size:
        raise KvstrataError(f"{args.text} has {len(ids)} tokens, fewer than the {start + count * size} of {documents} "
                            f"prefixes of {prefix_tokens} and {count} questions of {size}")
    prefix = [ids[d * prefix_tokens : (d + 1) * prefix_tokens] for d in range(documents)]
    return [prefix[i % documents] + ids[start + i * size : start + (i + 1) * size] for i in range(count)]


def _compare(engines: dict, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    results = take_turns(engines, args.rounds, lambda engine: _run(engine, prompts, params), alternate=True)
    runs = {name: [figures for figures, _ in one] for name, one in results.items()}
    cascade, plain = (results[name][-1][1] for name in ("cascade", "plain"))
    plain_rounds = [outputs for _, outputs in results["plain"]]
    exact = medians(runs)
    return {
        "runs": runs,
        "medians": {name: {key: sig(value) for key, value in one.items()} for name, one in exact.items()},
        "cascade_over_plain": {key: sig(exact["cascade"][key] / exact["plain"][key])
                               for key in ("decode_tokens_per_s", "output_tokens_per_s")},
        "same_greedy_outputs": sum(a == b for a, b in zip(cascade, plain)),
        "plain_same_every_round": sum(all(one == first for one in others)
                                      for first, *others in zip(*plain_rounds)),
    }


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[dict, list[list[int]]]:
    """Every prompt sent at once and run to its end, the prefix cache emptied first; the run's figures and each
    request's output tokens."""
    engine.reset_prefix_cache()
    engine.step_stats.clear()
    kernel = paged_decode.kernel()
    reads = kernel.shared_prefix_reads() if kernel is not None else 0
    start = time.perf_counter()
    outputs = run_together(engine, prompts, [params] * len(prompts))
    seconds = time.perf_counter() - start
    decodes = [step for step in engine.step_stats if step.prefill_tokens == 0]
    figures = {
        "seconds": seconds,
        "decode_tokens_per_s": sum(step.decode_tokens for step in decodes) / sum(step.seconds for step in decodes),
        "output_tokens_per_s": len(prompts) * params.max_tokens / seconds,
        "preemptions": sum(step.num_preempted for step in engine.step_stats),
        "shared_prefix_reads": (kernel.shared_prefix_reads() if kernel is not None else 0) - reads,
    }
    return figures, [list(out.token_ids) for out in outputs]
