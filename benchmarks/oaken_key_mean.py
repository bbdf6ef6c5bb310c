"""How much of a key is the layer's mean key, on the default model: why Oaken centers keys (docs/BENCHMARKS.md).

    .venv/bin/python -m benchmarks.oaken_key_mean > benchmarks/results/oaken_key_mean.json

Keys of `--windows` windows of `--window-tokens` Emma tokens (positions 0..T-1 in each window), against the shipped
calibration's mean key (profiled on Pride and Prejudice). Per layer, the share of the keys' mean square that
an offset removes, 1 - mean ||k - offset||^2 / mean ||k||^2:
  mean_key        the mean key, before RoPE; after RoPE, rotated to each key's position (what Oaken subtracts by
                  default): rotations keep norms, so the share is the same on both sides of RoPE
  one_offset_after_rope   for comparison, the window's own mean of post-RoPE keys: the best single offset that
                  ignores positions
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from kvstrata.bench.report import engine_info, machine_info, sig
from kvstrata.config import EngineConfig
from kvstrata.data import EMMA
from kvstrata.engine.direct_forward import compute_kv
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.kv.formats.oaken.thresholds import DEFAULT_RATIOS, stored_thresholds
from kvstrata.model.rotary import RotaryEmbedding, apply_rope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(threads=args.threads, kv_cache_memory="64MiB", max_model_len=args.window_tokens,
                                    enable_prefix_caching=False))
    mean = stored_thresholds(engine.model_fingerprint, DEFAULT_RATIOS).k_mean  # [L, W]
    token_ids = engine.tokenize(EMMA.read_text(encoding="utf-8"))
    starts = np.linspace(0, len(token_ids) - args.window_tokens, args.windows).astype(int).tolist()
    cos, sin = RotaryEmbedding(engine.loaded.config).cos_sin(torch.arange(args.window_tokens), torch.float32)
    power = 0.0
    centered = {"mean_key": 0.0, "one_offset_after_rope": 0.0}
    for start in starts:
        k, _ = compute_kv(engine, token_ids[start : start + args.window_tokens])  # [L, T, heads, D], after RoPE
        rotated_mean = apply_rope(mean.view(k.shape[0], 1, *k.shape[2:]).expand_as(k), cos, sin)
        power += k.square().mean((1, 2, 3)) / len(starts)
        for name, offset in (("mean_key", rotated_mean), ("one_offset_after_rope", k.mean(1, keepdim=True))):
            centered[name] += (k - offset).square().mean((1, 2, 3)) / len(starts)
    shares = {name: 1 - removed / power for name, removed in centered.items()}
    report = {
        "benchmark": "oaken_key_mean",
        "machine": machine_info(),
        **engine_info(engine),
        "workload": {"text": EMMA.name, "windows": len(starts), "window_tokens": args.window_tokens,
                     "mean_key": "shipped calibration (prideprejudice.txt)"},
        "mean_share_of_key_power": {
            name: {"min": sig(float(s.min())), "max": sig(float(s.max())), "median": sig(float(s.median())),
                   "per_layer": [sig(float(x), 3) for x in s]}
            for name, s in shares.items()
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
