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

    agreement = evals.add_parser(
        "agreement", help="greedy agreement and KL of configurations against a reference",
        description="The engine flags give the reference (normally the full-precision cache); each --compare "
                    "configuration scores the reference's greedy continuations through its own cache. Reports "
                    "`agreement` (argmax equals the reference token) and `kl` (mean KL(reference || config)).",
    )
    agreement.add_argument("--text", type=Path, default=EMMA, help="UTF-8 text the prompts are cut from")
    agreement.add_argument("--prompts", type=int, default=8, help="number of prompts (default: 8)")
    agreement.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt (default: 256)")
    agreement.add_argument("--gen-len", type=int, default=64, help="continuation tokens scored (default: 64)")
    _add_common(agreement)

    needle = evals.add_parser(
        "needle", help="passkey retrieval at several context lengths and depths",
        description="A 5-digit pass key is hidden at each depth of a haystack cut from --text; the answer is "
                    "right when its first number is exactly the key. Reports `accuracy` and a (length, depth) grid.",
    )
    needle.add_argument("--text", type=Path, default=EMMA, help="UTF-8 haystack text")
    needle.add_argument("--lengths", default="512,1024,2048,4096", help="prompt lengths in tokens")
    needle.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths, fractions of the haystack")
    needle.add_argument("--trials", type=int, default=2, help="prompts per (length, depth) (default: 2)")
    needle.add_argument("--seed", type=int, default=0)
    _add_common(needle)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compare", default=None,
                        help="evaluate several configurations: comma-separated, each '+'-joined OPTION=VALUE "
                             "overrides of the engine flags, e.g. dtype=float32,dtype=bfloat16")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON document on stdout")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG plot here")
    add_engine_arguments(parser)


def run_eval(args: argparse.Namespace) -> None:
    from kvstrata.eval.compare import compared_options
    from kvstrata.eval.run import run_agreement, run_needle, run_perplexity

    config = engine_config_from_args(args, varied=compared_options(args.compare))
    {"ppl": run_perplexity, "agreement": run_agreement, "needle": run_needle}[args.eval](args, config)
