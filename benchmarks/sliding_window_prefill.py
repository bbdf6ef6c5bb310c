"""Time to first token of long prompts under a sliding window, against the same model attending to every key
(docs/BENCHMARKS.md, "Sliding window: long prompts").

    .venv/bin/python -m benchmarks.sliding_window_prefill > benchmarks/results/sliding_window_prefill.json

No model shipped here has a sliding window, so one engine imposes `--window` on the default model (as its
ModelConfig.sliding_window) and another runs it as it is; past the window the first one's outputs are not what the
model was trained to give, so this measures time only. For each length (`--lengths`) and text (Emma, the Python
tutorial), `--repeats` prompts of exactly that many tokens (consecutive windows of the text) go through both
engines one after the other (each engine's prefix cache reset first, so the whole prompt is prefilled in chunks
of the default `--chunk-size`; TTFT from the request's arrival). Reported: every TTFT, the medians, and the
windowed engine's median over the full one's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from benchmarks.prefill_ttft import TEXTS, kvstrata_ttft
from benchmarks.sliding_window_capacity import with_window
from kvstrata.bench.report import machine_info
from kvstrata.bench.workload import prompts_from_text
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--lengths", default="2048,4096,8000", help="prompt lengths, tokens")
    parser.add_argument("--repeats", type=int, default=1, help="prompts per length and text")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]

    full = LLMEngine(EngineConfig(threads=2))
    loaded = with_window(full.loaded, args.window)
    engines = {"windowed": LLMEngine(full.config, loaded=loaded), "full": full}
    for engine in engines.values():  # warm-up: kernels, buffers
        kvstrata_ttft(engine, prompts_from_text(full.tokenizer, 1, 256)[0])
    rows = []
    for length in lengths:
        times = {name: [] for name in engines}
        for text, path in TEXTS.items():
            for prompt in prompts_from_text(full.tokenizer, args.repeats, length, path):
                for name, engine in engines.items():
                    times[name].append(kvstrata_ttft(engine, prompt))
                print(length, text, {k: round(v[-1], 3) for k, v in times.items()}, file=sys.stderr, flush=True)
        row = {"prompt_tokens": length}
        for name, seconds in times.items():
            row[name] = {"ttft_s": [round(s, 3) for s in seconds], "median_ttft_s": round(statistics.median(seconds), 3)}
        row["windowed_over_full"] = round(row["windowed"]["median_ttft_s"] / row["full"]["median_ttft_s"], 3)
        rows.append(row)
    print(json.dumps({"benchmark": "sliding_window_prefill", "machine": machine_info(), "model": loaded.name,
                      "window": args.window, "chunk_size": full.config.chunk_size, "texts": list(TEXTS),
                      "results": rows}, indent=2))


if __name__ == "__main__":
    main()
