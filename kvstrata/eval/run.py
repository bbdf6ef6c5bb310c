"""Run an evaluation over every configuration of `--compare` and report it."""

from __future__ import annotations

import argparse
import dataclasses

from kvstrata.bench.report import emit, engine_info, machine_info
from kvstrata.bench.workload import prompts_from_text, read_text
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.errors import KvstrataError
from kvstrata.eval import plots
from kvstrata.eval.agreement import compare_distributions, continuation_log_probs, greedy_continuations
from kvstrata.eval.compare import configurations
from kvstrata.eval.needle import evaluate_needle
from kvstrata.eval.perplexity import evaluate_perplexity


def _check_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise KvstrataError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")


def _numbers(text: str, kind, flag: str) -> list:
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise KvstrataError(f"--{flag} takes comma-separated numbers, got {text!r}") from exc


def _report(evaluation: str, headline: str, workload: dict, results: list[dict]) -> dict:
    first = results[0][headline]
    return {
        "evaluation": evaluation,
        "machine": machine_info(),
        "workload": workload,
        "results": results,
        headline: first,
        "ratios_to_first": {r["label"]: round(r[headline] / first, 5) if first else None for r in results},
    }


def kv_reads(engine: LLMEngine) -> dict:
    """What the KV policy read over the evaluation (--kv-offload full|infinigen|h2o): fractions fetched, bytes."""
    stats = getattr(engine.attention, "stats", None)
    return {"kv_reads": stats.summary()} if stats is not None else {}


def run_perplexity(args: argparse.Namespace, base: EngineConfig) -> None:
    _check_positive(args, "context_len", "score_len", "windows", "tokens_per_step")
    text = read_text(args.text)
    results = []
    for label, config in configurations(base, args.compare):
        engine = LLMEngine(config)
        figures = evaluate_perplexity(
            engine, engine.tokenize(text), args.context_len, args.score_len, args.windows, args.tokens_per_step
        )
        results.append({"label": label, **engine_info(engine), **figures, **kv_reads(engine)})
    workload = {"text": str(args.text), "context_len": args.context_len, "score_len": args.score_len,
                "windows": args.windows, "tokens_per_step": args.tokens_per_step}
    if args.plot:
        plots.perplexity_segments(results, args.plot)
    emit(_report("ppl", "perplexity", workload, results), args.json)


def run_agreement(args: argparse.Namespace, base: EngineConfig) -> None:
    _check_positive(args, "prompts", "prompt_len", "gen_len")
    reference_engine = LLMEngine(base)
    prompts = prompts_from_text(reference_engine.tokenizer, args.prompts, args.prompt_len, args.text)
    tokens = greedy_continuations(reference_engine, prompts, args.gen_len)
    reference = continuation_log_probs(reference_engine, prompts, tokens)
    del reference_engine
    results = []
    for label, config in configurations(base, args.compare):
        engine = LLMEngine(config)
        figures = compare_distributions(reference, continuation_log_probs(engine, prompts, tokens), tokens)
        results.append({"label": label, **engine_info(engine), **figures, **kv_reads(engine)})
    workload = {"text": str(args.text), "prompts": args.prompts, "prompt_len": args.prompt_len,
                "gen_len": args.gen_len, "reference_config": dataclasses.asdict(base)}
    if args.plot:
        plots.agreement_bars(results, args.plot)
    emit(_report("agreement", "agreement", workload, results), args.json)


def run_needle(args: argparse.Namespace, base: EngineConfig) -> None:
    _check_positive(args, "trials")
    lengths = _numbers(args.lengths, int, "lengths")
    depths = _numbers(args.depths, float, "depths")
    if not lengths or not depths or any(not 0 <= d <= 1 for d in depths):
        raise KvstrataError(f"--depths must be fractions in [0, 1] and --lengths non-empty, got {args.depths!r}")
    text = read_text(args.text)
    results = []
    for label, config in configurations(base, args.compare):
        engine = LLMEngine(config)
        figures = evaluate_needle(engine, text, lengths, depths, args.trials, args.seed)
        results.append({"label": label, **engine_info(engine), **figures, **kv_reads(engine)})
    workload = {"text": str(args.text), "lengths": lengths, "depths": depths, "trials": args.trials,
                "seed": args.seed}
    if args.plot:
        plots.needle_heatmaps(results, lengths, depths, args.plot)
    emit(_report("needle", "accuracy", workload, results), args.json)
