"""CacheGen size against quality on the default model (docs/BENCHMARKS.md, "CacheGen codec").

    .venv/bin/python -m benchmarks.cachegen_quality --part corpora [--levels medium,high] [--forms importance,transform] \
        [--windows-per-text 3] > benchmarks/results/cachegen_quality_corpora.json
    .venv/bin/python -m benchmarks.cachegen_quality --part austen > benchmarks/results/cachegen_quality.json

For 3,072-token contexts (two 1,536-token chunks each): bytes per token, bits per value, perplexity of the
next 512 tokens read through the decoded cache, and greedy agreement with the uncompressed cache.

`corpora`: seven texts, five the codec's choices were made on (Emma, Persuasion, KJV Acts, the Python
logging cookbook, Python's argparse module) and two held out (KJV 1 Samuel, the Python tutorial); every
level with its steps by layer third, from the shipped profile's sensitivity (calibrated on Pride and
Prejudice), from that sensitivity and each token's importance, and the same over each KV head's decorrelated
components (the profile's transforms: saved contexts' form), and as the KV store's objects (one per layer and
256 tokens) over channels and over components, against 8-bit and 4-bit uniform quantization, per text (one window
from character 50,000, or up to three, 16,000 characters apart).
`austen`: Emma and Persuasion, every level and baseline without channel weighting, the paper's ablation
(§7.5), offline profiled against per-chunk counted coder models (each text coded with a profile
calibrated on the other novel), and the quality loss when one layer third is quantized coarsely (Insight 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np
import torch

from benchmarks.cachegen_common import (
    CONTEXT_TOKENS,
    HELD_OUT_TEXTS,
    SCORED_TOKENS,
    TEXTS,
    TUNING_TEXTS,
    StoreObjects,
    Window,
    round_trip,
)
from kvstrata.bench.report import engine_info, machine_info, sig
from kvstrata.cachegen.levels import (
    ALL_LEVELS,
    COMPONENT_LEVELS,
    IMPORTANCE_LEVELS,
    LEVELS,
    SENSITIVITY_LEVELS,
    TRANSFORM_LEVELS,
    CodecSettings,
)
from kvstrata.cachegen.profile import calibrate, shipped_profile
from kvstrata.kv.store.forms import stored_form
from kvstrata.llm import LLM

ABLATION = {
    "1 uniform step, one global coder model": CodecSettings(bins=(1, 1, 1), differences="none", models="global"),
    "2 + per-(layer, channel) models": CodecSettings(bins=(1, 1, 1), differences="none"),
    "3 + anchor differences (K and V)": CodecSettings(bins=(1, 1, 1), differences="kv"),
    "4 + layer-wise bins (0.5, 1, 1.5)": CodecSettings(bins=(0.5, 1, 1.5), differences="kv"),
    "5 V coded directly, differences for K only (medium)": CodecSettings(bins=(0.5, 1, 1.5)),
}
COARSE_THIRD = {"none": (0.5, 0.5, 0.5), "first": (3, 0.5, 0.5), "middle": (0.5, 3, 0.5), "last": (0.5, 0.5, 3)}


def evaluate(windows: list[Window], settings: CodecSettings | StoreObjects, profiles=None) -> dict:
    """`settings`: the codec's, for chunks of 1,536 tokens, or the KV store's objects (which carry their own
    profile). `profiles`: each window's CodecProfile by text name, for the codec's profiled models or sensitivity
    steps."""
    rows = []
    for window in windows:
        profile = profiles[window.name] if profiles else None
        if isinstance(settings, StoreObjects):
            (k, k_bytes), (v, v_bytes) = settings.round_trip(window.k, "k"), settings.round_trip(window.v, "v")
        else:
            k, k_bytes = round_trip(window.k, settings, "k", profile=profile and profile.k,
                                    importance=window.importance)
            v, v_bytes = round_trip(window.v, settings, "v", profile=profile and profile.v,
                                    importance=window.importance)
        rows.append({"bytes": k_bytes + v_bytes, "values": 2 * window.k.numel(), "tokens": window.k.shape[1],
                     **window.quality(k, v)})
    size = sum(r["bytes"] for r in rows)
    return {
        "bits_per_value": sig(8 * size / sum(r["values"] for r in rows)),
        "bytes_per_token": sig(size / sum(r["tokens"] for r in rows)),
        "perplexity": sig(float(np.mean([r["perplexity"] for r in rows]))),
        "agreement": sig(float(np.mean([r["agreement"] for r in rows]))),
        "kl": sig(float(np.mean([r["kl"] for r in rows]))),
        "per_window": [{"text": w.name, "offset_chars": w.offset_chars, **{k: sig(v) for k, v in r.items()}}
                       for w, r in zip(windows, rows)],
    }


def smallest_within_1pct(rows: dict[str, dict], eight_bit: dict) -> dict | None:
    within = [(row["bits_per_value"], name) for name, row in rows.items()
              if row["perplexity"] <= 1.01 * eight_bit["perplexity"]]
    if not within:
        return None
    bits, name = min(within)
    return {"level": name, "bits_per_value": bits, "size_ratio_vs_8bit": sig(eight_bit["bits_per_value"] / bits)}


# A level's rows in `corpora`: the codec's forms, then the KV store's objects over channels and over components.
FORMS = ("plain", "sensitivity", "importance", "transform", "store-channels", "store-components")
WINDOW_SPACING = 16_000  # characters between a text's windows (a window's 3,584 tokens take ~11-15,000)


def corpora(engine, levels: tuple[str, ...] = tuple(LEVELS), forms: tuple[str, ...] = FORMS,
            windows_per_text: int = 1) -> dict:
    """`levels` with steps by layer third ("plain"), from sensitivity, from sensitivity and each token's importance,
    and the same over each KV head's decorrelated components ("transform": what saved contexts use), and as the KV
    store's objects over channels and over components, on the tuning and the held-out texts, `windows_per_text`
    windows each."""
    shipped = shipped_profile(engine.model_fingerprint)
    roles = {name: "tuning" for name in TUNING_TEXTS} | {name: "held-out" for name in HELD_OUT_TEXTS}
    windows = {name: [Window(engine, name, 50_000 + i * WINDOW_SPACING) for i in range(windows_per_text)]
               for name in roles}
    exact = {name: sig(float(np.mean([w.quality(w.k, w.v)["perplexity"] for w in ws]))) for name, ws in windows.items()}
    rows = {name: ALL_LEVELS[name] for name in ("uniform8", "uniform4-ac")}
    for level in levels:
        store_form = stored_form(level, torch.float32, shipped)
        forms_of_level = {"plain": LEVELS[level], "sensitivity": SENSITIVITY_LEVELS[level],
                          "importance": IMPORTANCE_LEVELS.get(level), "transform": TRANSFORM_LEVELS.get(level),
                          "store-channels": StoreObjects(store_form, positioned=False),
                          "store-components": StoreObjects(store_form, positioned=True)
                          if level in COMPONENT_LEVELS and shipped is not None and shipped.has_transforms else None}
        for form in forms:
            if forms_of_level[form] is not None:
                rows[level if form == "plain" else f"{level}+{form}"] = forms_of_level[form]
    per_text = {}
    for name, settings in rows.items():
        per_text[name] = {text: evaluate(ws, settings, {text: shipped}) for text, ws in windows.items()}
        print(name, {t: r["perplexity"] for t, r in per_text[name].items()}, file=sys.stderr, flush=True)
    against_8bit = {
        name: {text: {"size_ratio_vs_8bit": sig(per_text["uniform8"][text]["bits_per_value"] / row["bits_per_value"]),
                      "perplexity_vs_8bit": sig(row["perplexity"] / per_text["uniform8"][text]["perplexity"] - 1)}
               for text, row in texts.items()}
        for name, texts in per_text.items()
    }
    return {
        "workload": {"texts": roles, "windows_per_text": windows_per_text, "window_spacing_chars": WINDOW_SPACING,
                     "context_tokens": CONTEXT_TOKENS, "scored_tokens": SCORED_TOKENS,
                     "chunk_tokens": 1536, "coder_models": "counted per chunk",
                     "sensitivity": "shipped profile (calibrated on Pride and Prejudice)",
                     "importance": "attention of the context's last 128 tokens (kvstrata/cachegen/token_importance.py)",
                     "transform": "each KV head's decorrelating transform from the shipped profile (transform.py)",
                     "store": "objects of one layer and 256 tokens, coder models fitted per channel or component "
                              "(kv/store/forms.py); payload bytes"},
        "uncompressed_perplexity": exact,
        "levels": {name: {text: {k: row[k] for k in ("bits_per_value", "bytes_per_token", "perplexity", "agreement", "kl")}
                          for text, row in texts.items()} for name, texts in per_text.items()},
        "against_8bit": against_8bit,
        "smallest_within_1pct_of_8bit": {
            text: smallest_within_1pct({name: texts[text] for name, texts in per_text.items()},
                                       per_text["uniform8"][text])
            for text in windows
        },
    }


def austen(engine) -> dict:
    windows = [Window(engine, name) for name in TEXTS]
    exact = {"perplexity": sig(float(np.mean([w.quality(w.k, w.v)["perplexity"] for w in windows])))}
    levels = {name: evaluate(windows, settings) for name, settings in ALL_LEVELS.items()}
    for name, row in levels.items():
        print(name, row["bits_per_value"], row["perplexity"], file=sys.stderr, flush=True)
    ablation = {name: evaluate(windows, settings) for name, settings in ABLATION.items()}
    sensitivity = {third: evaluate(windows, CodecSettings(bins=bins)) for third, bins in COARSE_THIRD.items()}

    # Profiles from the other novel, so no evaluated context was seen in calibration.
    profiles = {}
    for name in TEXTS:
        other = next(n for n in TEXTS if n != name)
        tokens = engine.tokenize(TEXTS[other].read_text(encoding="utf-8"))
        profiles[name] = calibrate(engine, tokens, windows=100, window_tokens=512)
    model_source = {
        level: {"chunk": levels[level],
                "profiled": evaluate(windows, dataclasses.replace(LEVELS[level], source="profiled"), profiles)}
        for level in LEVELS
    }
    eight_bit = levels["uniform8"]
    return {
        "workload": {"texts": list(TEXTS), "context_tokens": windows[0].k.shape[1], "scored_tokens": 512,
                     "chunk_tokens": 1536, "values_per_token": 2 * windows[0].k[:, 0].numel()},
        "uncompressed": exact, "levels": levels, "ablation": ablation, "coarse_third": sensitivity,
        "model_source": model_source,
        "smallest_level_within_1pct_of_8bit": {
            source: smallest_within_1pct({name: model_source[name][source] for name in LEVELS}, eight_bit)
            for source in ("chunk", "profiled")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("corpora", "austen"), default="corpora")
    parser.add_argument("--levels", default=",".join(LEVELS), help="corpora: the CacheGen levels (default: all)")
    parser.add_argument("--forms", default=",".join(FORMS), help=f"corpora: each level's forms (default: {','.join(FORMS)})")
    parser.add_argument("--windows-per-text", type=int, default=1, help="corpora: windows per text (default: 1)")
    args = parser.parse_args()
    levels = tuple(level.strip() for level in args.levels.split(",") if level.strip())
    forms = tuple(form.strip() for form in args.forms.split(",") if form.strip())
    if any(level not in LEVELS for level in levels):
        parser.error(f"--levels {args.levels!r}: each must be one of {', '.join(LEVELS)}")
    if not forms or any(form not in FORMS for form in forms):
        parser.error(f"--forms {args.forms!r}: each must be one of {', '.join(FORMS)}")
    if not 1 <= args.windows_per_text <= 3:
        parser.error(f"--windows-per-text {args.windows_per_text}: 1 to 3 (the shortest text holds three)")
    engine = LLM(threads=2).engine
    report = {"machine": machine_info(), "engine": engine_info(engine), "part": args.part,
              **(corpora(engine, levels, forms, args.windows_per_text) if args.part == "corpora" else austen(engine))}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
