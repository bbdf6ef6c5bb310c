"""The CacheGen paper's Insights 1 and 3 on the default model (Insight 2 is in cachegen_quality).

    .venv/bin/python -m benchmarks.cachegen_insights > benchmarks/results/cachegen_insights.json

Insight 1: per layer, for K and V, the variance of raw values against that of differences between
consecutive tokens and between a token and its group's anchor (same layer and channel).
Insight 3: empirical entropy (bits per value) of quantized values with no grouping, and grouped by
token position, by channel and by layer. Values are quantized with one step for the whole tensor
(0.25 of its standard deviation), so grouping alone explains the differences.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from benchmarks.cachegen_common import Window
from kvstrata.bench.report import machine_info, sig
from kvstrata.cachegen.quantize import GROUP_SIZE
from kvstrata.llm import LLM


def variances(x: torch.Tensor) -> dict:
    """x [L, T, C]: per layer, the mean over channels of the variance over tokens."""
    anchors = x[:, torch.arange(x.shape[1]) // GROUP_SIZE * GROUP_SIZE]
    non_anchor = torch.arange(x.shape[1]) % GROUP_SIZE != 0
    raw = x.var(dim=1).mean(dim=1)
    consecutive = (x[:, 1:] - x[:, :-1]).var(dim=1).mean(dim=1)
    anchor = (x - anchors)[:, non_anchor].var(dim=1).mean(dim=1)
    return {
        "raw": [sig(v) for v in raw.tolist()],
        "consecutive_difference": [sig(v) for v in consecutive.tolist()],
        "anchor_difference": [sig(v) for v in anchor.tolist()],
        "raw_over_consecutive": {"min": sig((raw / consecutive).min().item()), "max": sig((raw / consecutive).max().item()),
                                 "median": sig((raw / consecutive).median().item())},
        "raw_over_anchor": {"min": sig((raw / anchor).min().item()), "max": sig((raw / anchor).max().item()),
                            "median": sig((raw / anchor).median().item())},
    }


def conditional_entropy(symbols: np.ndarray, groups: np.ndarray) -> float:
    """H(symbol | group) in bits, from joint counts."""
    _, symbol_ids = np.unique(symbols, return_inverse=True)
    _, group_ids = np.unique(groups, return_inverse=True)
    joint = np.bincount(group_ids * (symbol_ids.max() + 1) + symbol_ids).astype(np.float64)
    joint = joint[joint > 0] / symbols.size
    group_p = np.bincount(group_ids).astype(np.float64) / symbols.size
    return float(-(joint * np.log2(joint)).sum() + (group_p[group_p > 0] * np.log2(group_p[group_p > 0])).sum())


def entropies(x: torch.Tensor) -> dict:
    symbols = torch.round(x / (0.25 * x.std())).numpy().astype(np.int64)
    layers, tokens, channels = np.indices(symbols.shape)
    flat = symbols.reshape(-1)
    return {
        "none": sig(conditional_entropy(flat, np.zeros_like(flat))),
        "by_token": sig(conditional_entropy(flat, tokens.reshape(-1))),
        "by_channel": sig(conditional_entropy(flat, channels.reshape(-1))),
        "by_layer": sig(conditional_entropy(flat, layers.reshape(-1))),
    }


def main() -> None:
    engine = LLM(threads=2).engine
    report = {"machine": machine_info(), "model": engine.loaded.name, "texts": {}}
    for name in ("emma", "persuasion"):
        window = Window(engine, name)
        report["texts"][name] = {
            kind: {"variance": variances(flat), "entropy_bits": entropies(flat)}
            for kind, x in (("k", window.k), ("v", window.v))
            for flat in [x.reshape(x.shape[0], x.shape[1], -1)]
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
