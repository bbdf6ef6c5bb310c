"""Oaken's Observations 1-2 on the default model: K/V ranges differ across layers, and agree across inputs
(papers/oaken.md §2, §7.1).

    .venv/bin/python -m benchmarks.oaken_observations > benchmarks/results/oaken_observations.json

Thresholds (4/90/6) are calibrated on Emma and on Persuasion with the same windows (`--windows` x
`--window-tokens`); the shipped calibration (Pride and Prejudice, 100 x 512) joins as a third novel. Per layer,
for K before RoPE, K after RoPE and V: the outer and inner (lo, hi) thresholds. Across layers (Observation 1):
the max/min and the coefficient of variation of the outer range (hi - lo) per layer. Across novels
(Observation 2), per pair and layer: the relative difference of the outer range, and each threshold's shift as
a fraction of the layer's outer range; mean and max over layers. `layers_vs_novels` divides the layers'
coefficient of variation by the mean relative difference between novels: well above 1 means the ranges vary far
more from layer to layer than from text to text.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.oaken_common import PERSUASION
from kvstrata.bench.report import engine_info, machine_info, sig
from kvstrata.config import EngineConfig
from kvstrata.data import EMMA
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.kv.formats.oaken.thresholds import DATA_DIR, DEFAULT_RATIOS, OakenThresholds, calibrate, same_ratios

TABLES = ("k_pre_rope", "k_post_rope", "v")


def outer_range(table: torch.Tensor) -> torch.Tensor:
    """[layers]: hi - lo of the outermost boundary."""
    return table[:, 0, 1] - table[:, 0, 0]


def across_layers(table: torch.Tensor) -> dict:
    r = outer_range(table)
    return {"outer_range_min": sig(float(r.min())), "outer_range_max": sig(float(r.max())),
            "max_over_min": sig(float(r.max() / r.min())), "coefficient_of_variation": sig(float(r.std() / r.mean())),
            "widest_layer": int(r.argmax()), "narrowest_layer": int(r.argmin())}


def across_novels(a: torch.Tensor, b: torch.Tensor) -> dict:
    ra, rb = outer_range(a), outer_range(b)
    scale = (ra + rb) / 2
    relative = (ra - rb).abs() / scale
    shift = (a - b).abs().flatten(1).amax(1) / scale  # the most-moved threshold of each layer
    return {"outer_range_relative_difference": {"mean": sig(float(relative.mean())), "max": sig(float(relative.max())),
                                                "per_layer": [sig(float(x), 3) for x in relative]},
            "threshold_shift_over_outer_range": {"mean": sig(float(shift.mean())), "max": sig(float(shift.max()))}}


def per_layer(table: torch.Tensor) -> list[dict]:
    return [{"outer": [sig(float(x)) for x in layer[0]], "inner": [sig(float(x)) for x in layer[-1]]}
            for layer in table]


def plot(calibrations: dict[str, OakenThresholds], path: Path) -> None:
    from kvstrata.bench.plots import plt, save_figure

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, table in zip(axes, ("k_pre_rope", "v")):
        for (name, thresholds), color in zip(calibrations.items(), ("#3a6ea5", "#a55a3a", "#2a9d4a")):
            t = getattr(thresholds, table)
            layers = range(t.shape[0])
            ax.plot(layers, t[:, 0, 1], color=color, label=f"{name} outer hi / lo")
            ax.plot(layers, t[:, 0, 0], color=color)
            ax.plot(layers, t[:, -1, 1], color=color, linestyle=":")
            ax.plot(layers, t[:, -1, 0], color=color, linestyle=":")
        ax.set_title(f"{table} thresholds (dotted: inner)")
        ax.set_xlabel("layer")
    axes[0].legend(fontsize=7)
    save_figure(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=50)
    parser.add_argument("--window-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plot", type=Path, default=None, help="write the per-layer thresholds (PNG) here")
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(threads=args.threads, max_model_len=2048, kv_cache_memory="256MiB"))
    calibrations: dict[str, OakenThresholds] = {}
    seconds = {}
    for text in (EMMA, PERSUASION):
        start = time.perf_counter()
        ids = engine.tokenize(text.read_text(encoding="utf-8"))
        (calibrations[text.stem],) = calibrate(engine, ids, [DEFAULT_RATIOS], args.windows, args.window_tokens,
                                               progress=False, source=text.name)
        seconds[text.stem] = round(time.perf_counter() - start, 1)
        print(f"calibrated on {text.name} in {seconds[text.stem]} s", file=sys.stderr, flush=True)
    shipped = DATA_DIR / f"{engine.model_fingerprint}.json"
    if shipped.is_file():
        thresholds = OakenThresholds.load(shipped, engine.model_fingerprint)
        if same_ratios(thresholds.ratios, DEFAULT_RATIOS):
            calibrations[Path(thresholds.source).stem] = thresholds

    report_tables = {}
    for table in TABLES:
        layers = {name: across_layers(getattr(t, table)) for name, t in calibrations.items()}
        novels = {f"{a} vs {b}": across_novels(getattr(calibrations[a], table), getattr(calibrations[b], table))
                  for a, b in itertools.combinations(calibrations, 2)}
        mean_cv = sum(x["coefficient_of_variation"] for x in layers.values()) / len(layers)
        mean_difference = sum(x["outer_range_relative_difference"]["mean"] for x in novels.values()) / len(novels)
        report_tables[table] = {
            "across_layers": layers,
            "across_novels": novels,
            "layers_vs_novels": sig(mean_cv / mean_difference),
            "per_layer": {name: per_layer(getattr(t, table)) for name, t in calibrations.items()},
        }
    if args.plot:
        plot(calibrations, args.plot)
    report = {
        "benchmark": "oaken_observations",
        "machine": machine_info(),
        **engine_info(engine),
        "workload": {"ratios": list(DEFAULT_RATIOS),
                     "calibrations": {name: {"text": t.source, "windows": t.num_windows, "window_tokens": t.window_tokens,
                                             "seconds": seconds.get(name, "shipped")}
                                      for name, t in calibrations.items()}},
        "tables": report_tables,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
