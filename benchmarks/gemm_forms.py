"""Which GEMM wins at which batch: the default model's linear layers (`--weights auto`: GGUF blocks on torch's
packed int4 kernel) against the same weights as dense float32 and dense bfloat16 matrices, and against the
engine's path for many rows (model/int4_dense.py: the int4 weights widened to bfloat16 for each call, then a
dense bfloat16 product; only where that path is available).

    .venv/bin/python -m benchmarks.gemm_forms

For each number of rows M (1: a batch-1 decode; 32: 32 concurrent decodes; 128 to 1,024: prefill chunks) it
times one pass of M rows through every layer's projections (the LM head apart: it runs only for sampled rows),
median of `--repeats`, and prints milliseconds per pass and the rate in GFLOP/s for each form. The dense
matrices are the int4 kernel's own weights read back (the kernel applied to the identity), so all forms
multiply the same numbers up to bfloat16 rounding. Issue 17 asks to pick the fastest kernel per shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvstrata.bench.report import machine_info, sig
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.model import int4_dense
from kvstrata.model.quantized_linear import Int4Linear


def median_ms(run, inputs, repeats: int) -> float:
    run(inputs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def as_bf16(inputs: dict) -> dict:
    """Activations cast once per input width, as a bfloat16 model would carry them."""
    return {width: x.bfloat16() for width, x in inputs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,32,128,256,1024")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(threads=args.threads, kv_cache_memory="64MiB", max_model_len=1024))
    model = engine.loaded.model
    layers = [m for m in model.modules() if isinstance(m, Int4Linear) and m is not model.lm_head]
    with torch.inference_mode():
        dense = [layer(torch.eye(layer.in_features)).t().contiguous() for layer in layers]  # W [out, in]
        dense_bf16 = [w.bfloat16() for w in dense]
        weights = sum(w.numel() for w in dense)

        def bf16_dense(xs):
            xs = as_bf16(xs)
            return [xs[w.shape[1]] @ w.t() for w in dense_bf16]

        def widened_per_call(xs):
            xs = as_bf16(xs)
            return [xs[layer.in_features] @ int4_dense.dense_weight(layer.packed0, layer.scale_zero0,
                                                                    layer.group_size).t() for layer in layers]

        forms = {
            "int4 kernel": lambda xs: [layer(xs[layer.in_features]) for layer in layers],
            "fp32 dense": lambda xs: [xs[w.shape[1]] @ w.t() for w in dense],
            "bf16 dense": bf16_dense,
        }
        if int4_dense.available():
            forms["int4 widened per call"] = widened_per_call
        rows = []
        for m in map(int, args.rows.split(",")):
            inputs = {layer.in_features: torch.randn(m, layer.in_features) for layer in layers}
            row: dict = {"rows": m}
            for name, run in forms.items():
                ms = median_ms(run, inputs, args.repeats)
                row[name] = {"ms": sig(ms), "gflops": sig(2 * m * weights / ms / 1e6)}
            row["fastest"] = min(forms, key=lambda name: row[name]["ms"])
            rows.append(row)
    print(json.dumps({"benchmark": "gemm_forms", "machine": machine_info(), "model": engine.loaded.name,
                      "linear_weights": weights, "layers": len(layers), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
