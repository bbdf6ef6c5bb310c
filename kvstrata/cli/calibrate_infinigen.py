"""`kvstrata calibrate infinigen`: InfiniGen's skew matrices for a model, from its queries and keys on a text."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from kvstrata.cli.arg_types import output_file, positive_int
from kvstrata.cli.engine_args import add_engine_arguments, engine_config_from_args
from kvstrata.engine.kv_offload_setup import DEFAULT_WINDOW_TOKENS, DEFAULT_WINDOWS
from kvstrata.errors import KvstrataError


def add_infinigen_calibrate_command(calibrate_commands) -> None:
    """Adds `infinigen` to the subparsers of `kvstrata calibrate`."""
    infinigen = calibrate_commands.add_parser(
        "infinigen", help="compute InfiniGen's skew matrices for a model",
        description="Run windows of --text through the model, take per (layer, KV head) the right singular vectors "
                    "of the stacked post-RoPE queries as an orthogonal skew, and rank its channels by mean "
                    "|Q~| + |K~| (the partial keys take the top ones).",
    )
    infinigen.add_argument("--text", type=Path, required=True, help="UTF-8 calibration text")
    infinigen.add_argument("--out", type=output_file, required=True, help="the skew file (.npz) to write")
    infinigen.add_argument("--windows", type=positive_int, default=DEFAULT_WINDOWS,
                           help=f"windows of text (default: {DEFAULT_WINDOWS})")
    infinigen.add_argument("--window-tokens", type=positive_int, default=DEFAULT_WINDOW_TOKENS,
                           help=f"tokens per window (default: {DEFAULT_WINDOW_TOKENS})")
    add_engine_arguments(infinigen)


def run_infinigen_calibrate(args: argparse.Namespace) -> None:
    from kvstrata.bench.workload import read_text
    from kvstrata.engine.kv_offload_setup import calibrate_skew
    from kvstrata.engine.llm_engine import LLMEngine

    engine = LLMEngine(dataclasses.replace(engine_config_from_args(args, varied=("kv_offload",)), kv_offload="none"))
    if engine.tokenizer is None:
        raise KvstrataError("calibration needs a model with a tokenizer")
    skew = calibrate_skew(engine, engine.tokenize(read_text(args.text)), args.windows, args.window_tokens,
                          source=args.text.name)
    skew.save(args.out)
    share = skew.column_weights.topk(max(1, int(0.3 * skew.column_weights.shape[-1])), -1).values.sum(-1) \
        / skew.column_weights.sum(-1)
    print(f"wrote the infinigen skew of model {skew.fingerprint} ({skew.num_windows} windows x {skew.window_tokens} "
          f"tokens of {skew.source}) to {args.out}; the top 30% of skewed channels hold {share.mean():.1%} of "
          f"mean |Q~| + |K~|")
