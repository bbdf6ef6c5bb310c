"""`kvstrata calibrate oaken`: profile a model's Oaken thresholds on a text and write the thresholds file."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvstrata.cli.arg_types import output_file, positive_int
from kvstrata.cli.engine_args import add_engine_arguments, engine_config_from_args
from kvstrata.errors import KvstrataError
from kvstrata.kv.formats.oaken.groups import parse_ratios
from kvstrata.kv.formats.oaken.thresholds import (
    DEFAULT_RATIOS,
    DEFAULT_WINDOW_TOKENS,
    DEFAULT_WINDOWS,
    OakenThresholds,
    calibrate,
)


def add_oaken_calibrate_command(calibrate_commands) -> None:
    """Adds `oaken` to the subparsers of `kvstrata calibrate`."""
    oaken = calibrate_commands.add_parser(
        "oaken", help="profile Oaken's group thresholds for a model",
        description="Run windows of --text through the model and average, per layer, the quantiles of K (before "
                    "and after RoPE, as they are and minus the mean key) and V that separate Oaken's groups.",
    )
    oaken.add_argument("--text", type=Path, required=True, help="UTF-8 calibration text")
    oaken.add_argument("--out", type=output_file, required=True, help="the thresholds file (JSON) to write")
    oaken.add_argument("--windows", type=positive_int, default=DEFAULT_WINDOWS,
                       help=f"windows of text (default: {DEFAULT_WINDOWS})")
    oaken.add_argument("--window-tokens", type=positive_int, default=DEFAULT_WINDOW_TOKENS,
                       help=f"tokens per window (default: {DEFAULT_WINDOW_TOKENS})")
    oaken.add_argument("--ratios", default=",".join(f"{r:.2f}" for r in DEFAULT_RATIOS),
                       help="comma-separated group fractions, outermost first, 2 to 5 of them summing to 1 "
                            "(default: %(default)s)")
    add_engine_arguments(oaken)


def summary(thresholds: OakenThresholds) -> str:
    """The outermost boundary's thresholds, averaged over layers, for each table."""
    tables = {"K pre-RoPE": thresholds.k_pre_rope, "K post-RoPE": thresholds.k_post_rope,
              "K post-RoPE centered": thresholds.k_post_rope_centered, "V": thresholds.v}
    parts = [f"{name} [{table[:, 0, 0].mean():.4g}, {table[:, 0, 1].mean():.4g}]" for name, table in tables.items()]
    return f"outer thresholds (mean of {thresholds.num_layers} layers): " + ", ".join(parts)


def run_oaken_calibrate(args: argparse.Namespace) -> None:
    from kvstrata.bench.workload import read_text
    from kvstrata.engine.llm_engine import LLMEngine

    ratios = parse_ratios(args.ratios, "--ratios")
    engine = LLMEngine(engine_config_from_args(args))
    if engine.tokenizer is None:
        raise KvstrataError("calibration needs a model with a tokenizer")
    token_ids = engine.tokenize(read_text(args.text))
    (thresholds,) = calibrate(engine, token_ids, [ratios], args.windows, args.window_tokens, source=args.text.name)
    thresholds.save(args.out)
    print(f"wrote the oaken thresholds of model {thresholds.fingerprint} (ratios "
          f"{'/'.join(f'{r:g}' for r in thresholds.ratios)}, {thresholds.num_windows} windows x "
          f"{thresholds.window_tokens} tokens of {thresholds.source}) to {args.out}")
    print(summary(thresholds))
