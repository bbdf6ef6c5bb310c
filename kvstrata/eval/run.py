"""Run an evaluation over every configuration of `--compare` and report it."""

from __future__ import annotations

import argparse

from kvstrata.bench.report import emit, engine_info, machine_info
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.errors import KvstrataError
from kvstrata.eval.compare import configurations
from kvstrata.eval.perplexity import evaluate_perplexity


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise KvstrataError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def run_perplexity(args: argparse.Namespace, base: EngineConfig) -> None:
    for name in ("context_len", "score_len", "windows", "tokens_per_step"):
        _positive(name, getattr(args, name))
    try:
        text = args.text.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise KvstrataError(f"cannot read --text {args.text}: {exc}") from exc
    results = []
    for label, config in configurations(base, args.compare):
        engine = LLMEngine(config)
        token_ids = engine.tokenize(text)
        figures = evaluate_perplexity(
            engine, token_ids, args.context_len, args.score_len, args.windows, args.tokens_per_step
        )
        results.append({"label": label, **engine_info(engine), **figures})
    report = {
        "evaluation": "ppl",
        "machine": machine_info(),
        "workload": {"text": str(args.text), "context_len": args.context_len, "score_len": args.score_len,
                     "windows": args.windows, "tokens_per_step": args.tokens_per_step},
        "results": results,
        "perplexity": results[0]["perplexity"],
        "ratios_to_first": {r["label"]: round(r["perplexity"] / results[0]["perplexity"], 5) for r in results},
    }
    if args.plot:
        _plot_segments(results, args.plot)
    emit(report, args.json)


def _plot_segments(results: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot([s["to"] for s in r["segments"]], [s["perplexity"] for s in r["segments"]], marker="o",
                label=f"{r['label']} (ppl {r['perplexity']})")
    ax.set_xlabel("position (end of 256-token segment)")
    ax.set_ylabel("perplexity")
    ax.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
