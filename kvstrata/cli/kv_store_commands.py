"""`kvstrata kv store stats | clear`: what a KV store (`--kv-store`) holds, per tier, and emptying it."""

from __future__ import annotations

import argparse
import json

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


def run_kv_store(args: argparse.Namespace) -> None:
    from kvstrata.errors import KvstrataError
    from kvstrata.kv.store.errors import StoreUnavailable

    try:
        _run(args)
    except StoreUnavailable as exc:
        raise KvstrataError(str(exc)) from None


def _run(args: argparse.Namespace) -> None:
    from kvstrata.kv.store.spec import parse_tiers

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
