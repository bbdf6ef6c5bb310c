"""Time to first token of long prompts prefilled from nothing: kvstrata at its defaults against transformers on the
same GGUF file, in the same run; and what a prompt chunk's attention costs in each of the reference attention's two
forms.

    .venv/bin/python -m benchmarks.prefill_ttft > benchmarks/results/prefill_ttft.json
    .venv/bin/python -m benchmarks.prefill_ttft --part calls > benchmarks/results/prefill_chunk_attention.json

`ttft`: for each length (`--lengths`) and text (Emma, the Python tutorial), `--repeats` prompts of exactly that many
tokens (consecutive windows of the text). Each prompt goes once through a kvstrata engine (its prefix cache reset
first, so the whole prompt is prefilled, in chunks of the default `--chunk-size`; TTFT from the request's
arrival) and once through transformers (the GGUF file dequantized to float32, one forward pass over the prompt
with its default SDPA attention, timed to the last position's logits), one after the other. Reported: every TTFT,
the medians, prompt tokens per second, and transformers' median over kvstrata's (above 1: kvstrata is first).

`calls`: one layer's attention of a prompt chunk (the default model's 9 query and 3 KV heads of 64) over a context
of random K/V, for chunks of 16-1,024 queries after 0-4,096 keys: `attend` with the causal mask against
`attend_prompt_chunk` (two unmasked calls merged), each the best of `--repeats` x 5 calls, interleaved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.kv_store_ttft import first_token
from kvstrata.bench.decode import gguf_file
from kvstrata.bench.report import machine_info
from kvstrata.bench.transformers_model import transformers_model
from kvstrata.bench.workload import prompts_from_text
from kvstrata.config import EngineConfig
from kvstrata.data import EMMA
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.kv.reference_attention import attend, attend_prompt_chunk, causal_mask

TEXTS = {"emma": EMMA, "python_tutorial": Path(__file__).parent / "data" / "python_tutorial.txt"}


def kvstrata_ttft(engine: LLMEngine, token_ids: list[int]) -> float:
    engine.reset_prefix_cache()
    return first_token(engine, token_ids).metrics.ttft


@torch.inference_mode()
def transformers_ttft(model, token_ids: list[int]) -> float:
    start = time.perf_counter()
    model(torch.tensor([token_ids]), logits_to_keep=1)
    return time.perf_counter() - start


def chunk_attention_calls(repeats: int) -> list[dict]:
    torch.set_num_threads(2)
    rows = []
    for before in (0, 512, 2048, 4096):
        for queries in (16, 64, 128, 256, 1024):
            q = torch.randn(1, queries, 9, 64)
            k, v = torch.randn(1, before + queries, 3, 64), torch.randn(1, before + queries, 3, 64)
            mask = causal_mask(torch.arange(before, before + queries)[None], torch.arange(before + queries)[None])
            forms = {"masked": lambda q=q, k=k, v=v, mask=mask: attend(q, k, v, mask),
                     "two_calls": lambda q=q, k=k, v=v, before=before: attend_prompt_chunk(q, k, v, before)}
            best = {name: float("inf") for name in forms}
            for _ in range(repeats * 5):
                for name, form in forms.items():
                    start = time.perf_counter()
                    form()
                    best[name] = min(best[name], time.perf_counter() - start)
            rows.append({"keys_before": before, "queries": queries, "masked_ms": round(best["masked"] * 1e3, 3),
                         "two_calls_ms": round(best["two_calls"] * 1e3, 3),
                         "masked_over_two_calls": round(best["masked"] / best["two_calls"], 3)})
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("ttft", "calls"), default="ttft")
    parser.add_argument("--lengths", default="1024,4096,8000", help="prompt lengths, tokens")
    parser.add_argument("--repeats", type=int, default=2, help="prompts per length and text (calls: x 5 calls)")
    parser.add_argument("--no-transformers", action="store_true", help="kvstrata alone")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.part == "calls":
        print(json.dumps({"benchmark": "prefill_chunk_attention", "machine": machine_info(),
                          "results": chunk_attention_calls(args.repeats)}, indent=2))
        return

    engine = LLMEngine(EngineConfig(threads=2))
    model = None if args.no_transformers else transformers_model(gguf_file(engine.loaded.source))
    kvstrata_ttft(engine, prompts_from_text(engine.tokenizer, 1, 256)[0])  # warm-up: kernels, buffers
    if model is not None:
        transformers_ttft(model, prompts_from_text(engine.tokenizer, 1, 256)[0])
    rows = []
    for length in lengths:
        times = {"kvstrata": [], "transformers": []}
        for name, path in TEXTS.items():
            for prompt in prompts_from_text(engine.tokenizer, args.repeats, length, path):
                times["kvstrata"].append(kvstrata_ttft(engine, prompt))
                if model is not None:
                    times["transformers"].append(transformers_ttft(model, prompt))
                print(length, name, {k: round(v[-1], 3) for k, v in times.items() if v}, file=sys.stderr, flush=True)
        row = {"prompt_tokens": length}
        for system, seconds in times.items():
            if seconds:
                median = statistics.median(seconds)
                row[system] = {"ttft_s": [round(s, 3) for s in seconds], "median_ttft_s": round(median, 3),
                               "prompt_tokens_per_s": round(length / median, 1)}
        if model is not None:
            row["transformers_over_kvstrata"] = round(row["transformers"]["median_ttft_s"]
                                                      / row["kvstrata"]["median_ttft_s"], 3)
        rows.append(row)
    print(json.dumps({"benchmark": "prefill_ttft", "machine": machine_info(), "model": engine.loaded.name,
                      "chunk_size": engine.config.chunk_size, "texts": list(TEXTS), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
