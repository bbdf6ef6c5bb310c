"""What Oaken's online path costs per token on this CPU: compare-based grouping against per-token top-k outlier
selection (KVQuant's way), and the whole encode / decode (papers/oaken.md §1, §6.2, §7.4).

    .venv/bin/python -m benchmarks.oaken_online_cost > benchmarks/results/oaken_online_cost.json

Data: the real V of one layer of the default model over an Emma window, with that layer's shipped thresholds
(4/90/6). Width 192 is the model's own (3 KV heads x 64); for width 4096 (a 7B model's) each token is 4,096 of
the layer's values drawn at random, so the same thresholds split it in the same fractions. Each operation runs
on batches of 1 and 64 tokens, timed as the best of `--repeats` runs of enough calls to last >= 20 ms:
  grouping        kvstrata.kv.formats.oaken.groups.assign_groups (comparisons against the thresholds only)
  topk_outer      torch.topk of |x| per token selecting the outer fraction (4%), as KVQuant picks outliers
  topk_both       two top-k per token, the largest 4% and the smallest 6% of |x|: the sort-based way to the
                  same three groups
  oaken_encode / oaken_decode   codec.encode_tokens / decode_tokens (grouping, shift, params, packing)
  int4_encode / int4_decode     the plain int4 format (groups of 64), for scale
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from kvstrata.bench.report import machine_info, sig
from kvstrata.config import EngineConfig
from kvstrata.data import EMMA
from kvstrata.engine.direct_forward import compute_kv
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.kv.formats.integer import Int4Format
from kvstrata.kv.formats.oaken.codec import decode_tokens, encode_tokens
from kvstrata.kv.formats.oaken.groups import OakenConfig, assign_groups
from kvstrata.kv.formats.oaken.thresholds import default_thresholds

MIN_SECONDS = 0.02


def best_seconds(call, repeats: int) -> float:
    """Best over `repeats` of the mean time of one call, each repeat lasting at least MIN_SECONDS."""
    call()  # warm-up (and caches such as the codec's prepared tables)
    start = time.perf_counter()
    call()
    calls = max(1, math.ceil(MIN_SECONDS / max(time.perf_counter() - start, 1e-7)))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def operations(x: torch.Tensor, bounds: torch.Tensor, config: OakenConfig) -> dict:
    width = x.shape[1]
    outer = max(1, round(config.ratios[0] * width))
    inner = max(1, round(config.ratios[-1] * width))
    encoded = encode_tokens(x, bounds, config)
    int4 = Int4Format(width)
    int4_encoded = int4.encode(x, 0, "v", None)
    return {
        "grouping": lambda: assign_groups(x, bounds),
        "topk_outer": lambda: torch.topk(x.abs(), outer, dim=1),
        "topk_both": lambda: (torch.topk(x.abs(), outer, dim=1), torch.topk(x.abs(), inner, dim=1, largest=False)),
        "oaken_encode": lambda: encode_tokens(x, bounds, config),
        "oaken_decode": lambda: decode_tokens(encoded.dense, encoded.sparse, bounds, config, width),
        "int4_encode": lambda: int4.encode(x, 0, "v", None),
        "int4_decode": lambda: int4.decode(int4_encoded.dense, None, 0, "v", None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="192,4096")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--window-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (per-token work; 1 avoids noise)")
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(threads=args.threads, max_model_len=2048, kv_cache_memory="256MiB"))
    torch.manual_seed(0)
    thresholds = default_thresholds(engine, progress=False)
    layer = thresholds.num_layers // 2
    bounds = thresholds.bounds(layer, "v")
    config = OakenConfig(ratios=thresholds.ratios)
    ids = engine.tokenize(EMMA.read_text(encoding="utf-8")[100_000:140_000])[: args.window_tokens]
    _, v = compute_kv(engine, ids)
    real = v[layer].reshape(len(ids), -1)
    batches = [int(b) for b in args.batches.split(",")]
    rows, ratios, fractions = [], {}, {}
    for width in (int(w) for w in args.widths.split(",")):
        pool = real if width == real.shape[1] else real.flatten()[torch.randint(real.numel(), (max(batches), width))]
        groups = assign_groups(pool, bounds)
        fractions[width] = [sig(float((groups == g).float().mean()), 3) for g in range(config.num_groups)]
        for batch in batches:
            x = pool[:batch].contiguous()
            us = {name: best_seconds(call, args.repeats) / batch * 1e6
                  for name, call in operations(x, bounds, config).items()}
            rows += [{"width": width, "batch": batch, "op": name, "us_per_token": sig(t)} for name, t in us.items()]
            ratios[f"width {width}, batch {batch}"] = {
                "topk_outer_vs_grouping": sig(us["topk_outer"] / us["grouping"]),
                "topk_both_vs_grouping": sig(us["topk_both"] / us["grouping"]),
                "grouping_share_of_oaken_encode": sig(us["grouping"] / us["oaken_encode"]),
                "oaken_encode_vs_int4_encode": sig(us["oaken_encode"] / us["int4_encode"]),
                "oaken_decode_vs_int4_decode": sig(us["oaken_decode"] / us["int4_decode"]),
            }
    report = {
        "benchmark": "oaken_online_cost",
        "machine": machine_info(),
        "model": engine.loaded.name,
        "workload": {"data": f"V of layer {layer}, {len(ids)} tokens of {EMMA.name}", "thresholds": thresholds.source,
                     "ratios": list(thresholds.ratios), "widths": list(fractions), "batches": batches,
                     "repeats": args.repeats, "min_seconds_per_repeat": MIN_SECONDS, "threads": args.threads,
                     "group_fractions_of_data": fractions},
        "results": rows,
        "ratios": ratios,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
