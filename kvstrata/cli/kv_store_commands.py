"""`kvstrata kv store stats | clear | reorder`: what a KV store (`--kv-store`) holds, per tier; emptying it; one
IMPRESS reordering pass over it now."""

from __future__ import annotations

import argparse
import dataclasses
import json

from kvstrata.cli.engine_args import add_engine_arguments, engine_config_from_args
from kvstrata.kv.store.spec import EXAMPLE


def add_kv_store_commands(kv_commands) -> None:
    store = kv_commands.add_parser("store", help="inspect or clear a KV store's tiers").add_subparsers(
        dest="store", required=True
    )
    stats = store.add_parser("stats", help="chunks and bytes each tier holds (a running server's hits, misses and "
                                           "traffic are on its /metrics)")
    clear = store.add_parser("clear", help="remove every chunk from every tier")
    for parser in (stats, clear):
        parser.add_argument("--kv-store", required=True, help=f"the store's tiers, as the engine takes them: {EXAMPLE}")
    stats.add_argument("--json", action="store_true", help="print exactly one JSON document")
    reorder = store.add_parser(
        "reorder", help="one IMPRESS reordering pass over the store's nodes, now",
        description="Sort every stored node's tokens per layer by the importance its IMPRESS loads recorded and "
                    "rewrite it (kv/impress/node_reordering.py), as a server with --prefix-loading impress does every "
                    "--impress-reorder-seconds. Takes the engine's options: the model and --kv-store-chunk-tokens "
                    "must be those of the engines that wrote the store (nodes of other models or chunk sizes are "
                    "left alone).")
    add_engine_arguments(reorder)


def run_kv_store(args: argparse.Namespace) -> None:
    from kvstrata.errors import KvstrataError
    from kvstrata.kv.store.errors import StoreUnavailable

    try:
        _run(args)
    except StoreUnavailable as exc:
        raise KvstrataError(str(exc)) from None


def _run(args: argparse.Namespace) -> None:
    from kvstrata.kv.store.spec import parse_tiers

    if args.store == "reorder":
        _reorder(args)
        return
    tiers = parse_tiers(args.kv_store)
    try:
        if args.store == "clear":
            for tier in tiers:
                tier.clear()
                print(f"cleared {tier.describe()}")
            return
        report = {"tiers": [{"tier": tier.name, "where": tier.describe(), **vars(tier.usage())} for tier in tiers]}
        if args.json:
            print(json.dumps(report, indent=2))
            return
        print(f"{'tier':<8}{'chunks':>10}{'bytes':>16}{'capacity':>16}  where")
        for row in report["tiers"]:
            capacity = "-" if row["capacity"] is None else row["capacity"]
            print(f"{row['tier']:<8}{row['chunks']:>10}{row['bytes']:>16}{capacity:>16}  {row['where']}")
    finally:
        for tier in tiers:
            tier.close()


def _reorder(args: argparse.Namespace) -> None:
    from kvstrata.engine.llm_engine import LLMEngine
    from kvstrata.errors import KvstrataError
    from kvstrata.kv.impress.node_reordering import importance_key, reorder_all

    config = engine_config_from_args(args, varied=("prefix_loading",))
    if config.kv_store is None:
        raise KvstrataError(f"kvstrata kv store reorder needs the store: --kv-store, e.g. {EXAMPLE}")
    # the store as an IMPRESS engine opens it (its probe keys), without the periodic pass of its own
    engine = LLMEngine(dataclasses.replace(config, prefix_loading="impress", impress_reorder_seconds=0))
    try:
        store = engine.kv_store.store
        recorded = len(store.stored_keys(importance_key("")))  # every node's importance record
        rewritten = reorder_all(store, engine.kv_store.chunk_tokens)
    finally:
        engine.close()
    others = " (the others had no load since their last pass, belong to another model or chunk size, or lack a " \
             "chunk)" if rewritten < recorded else ""
    print(f"reordered {rewritten} of the {recorded} nodes with recorded importance{others}")
