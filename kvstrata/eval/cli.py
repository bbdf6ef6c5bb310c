"""`kvstrata eval ...`: quality evaluations of engine configurations."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvstrata.cli.engine_args import add_engine_arguments, engine_config_from_args
from kvstrata.data import EMMA


def add_eval_commands(commands) -> None:
    evals = commands.add_parser("eval", help="quality evaluations").add_subparsers(dest="eval", required=True)
    ppl = evals.add_parser(
        "ppl", help="perplexity of a text, scored through the KV cache",
        description="Prefill a context of --context-len tokens, then score the next --score-len tokens in decode "
                    "mode (teacher-forced, --tokens-per-step at a time, each reading the cache), over --windows "
                    "windows spread over the text. Reports `perplexity`, per-window and per-256-token segments.",
    )
    ppl.add_argument("--text", type=Path, default=EMMA, help="UTF-8 text (default: Emma, shipped with kvstrata)")
    ppl.add_argument("--context-len", type=int, default=1024, help="tokens prefilled before scoring (default: 1024)")
    ppl.add_argument("--score-len", type=int, default=1024, help="tokens scored per window (default: 1024)")
    ppl.add_argument("--windows", type=int, default=2, help="windows spread over the text (default: 2)")
    ppl.add_argument(
        "--tokens-per-step", type=int, default=1,
        help="tokens fed per step while scoring; above 1 a scored token also attends to the other tokens of "
             "its step as written to and read back from the cache in that same step (default: 1, pure decode)",
    )
    _add_common(ppl)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compare", default=None,
                        help="evaluate several configurations: comma-separated, each '+'-joined OPTION=VALUE "
                             "overrides of the engine flags, e.g. dtype=float32,dtype=bfloat16")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON document on stdout")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG plot here")
    add_engine_arguments(parser)


def run_eval(args: argparse.Namespace) -> None:
    from kvstrata.eval.run import run_perplexity

    {"ppl": run_perplexity}[args.eval](args, engine_config_from_args(args))
