"""Which GEMM wins at which batch: the default model's linear layers (`--weights auto`: GGUF blocks on kvstrata's
integer dot products, model/block_linear.py) against the same blocks widened row by row inside the kernel (the
engine's path from 4 rows on CPUs without AVX-512 VNNI, model/kernels/widened_rows.cpp; timed from 4 rows, on any
CPU), on torch's packed int4 kernel, the same weights as dense float32 and dense bfloat16 matrices, and the
engine's path for many rows (the blocks widened for each call, then a dense product: in bfloat16 where the CPU has
bfloat16 dot products, else in float32).

    .venv/bin/python -m benchmarks.gemm_forms

For each number of rows M (1: a batch-1 decode; 32: 32 concurrent decodes; 128 to 1,024: prefill chunks) it
times one pass of M rows through every layer's projections (the LM head apart: it runs only for sampled rows),
median of `--repeats`, and prints milliseconds per pass and the rate in GFLOP/s for each form. The dense
matrices are the blocks' weights read back (the bfloat16 widening, exact for 4-bit codes times bfloat16-exact
scales up to rounding), so all forms multiply the same numbers up to rounding; the dot products also round the
activations to int8 per block of 32. Issue 17 asks to pick the fastest kernel per shape.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from kvstrata.bench.report import machine_info, sig
from kvstrata.bench.stats import median_seconds
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.model.block_linear import BLOCK, BlockLinear, kernel_paths, widened_dtype
from kvstrata.model.group_quantized import GroupQuantized
from kvstrata.model.quantized_linear import Int4Linear


def as_bf16(inputs: dict) -> dict:
    """Activations cast once per input width, as a bfloat16 model would carry them."""
    return {width: x.bfloat16() for width, x in inputs.items()}


def torch_int4(layer: BlockLinear) -> Int4Linear:
    """The same 4-bit blocks on torch's int4 kernel."""
    rows, cols = layer.out_features, layer.in_features
    halves = layer.codes.view(rows, cols // BLOCK, 1, BLOCK // 2)
    codes = torch.cat([halves & 15, halves >> 4], 2).view(rows, cols)
    return Int4Linear(GroupQuantized(codes, layer.scales, layer.mins, 4, BLOCK), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,32,128,256,1024")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(threads=args.threads, kv_cache_memory="64MiB", max_model_len=1024))
    model = engine.loaded.model
    layers = [m for m in model.modules() if isinstance(m, BlockLinear) and m is not model.lm_head]
    torch_layers = [torch_int4(layer) for layer in layers]
    with torch.inference_mode():
        # W [out, in], copied: _dense_weight() is a scratch buffer shared by every layer of its shape
        dense = [layer._dense_weight().to(torch.float32, copy=True) for layer in layers]
        dense_bf16 = [w.bfloat16() for w in dense]
        weights = sum(w.numel() for w in dense)

        def bf16_dense(xs):
            xs = as_bf16(xs)
            return [xs[w.shape[1]] @ w.t() for w in dense_bf16]

        def widened_per_call(xs):
            xs = {width: x.to(widened_dtype()) for width, x in xs.items()}
            return [xs[layer.in_features] @ layer._dense_weight().t() for layer in layers]

        def block_kernel(xs):
            return [torch.ops.kvstrata_weights.block_linear(xs[layer.in_features], layer.codes, layer.scales,
                                                            layer.mins, layer.bits) for layer in layers]

        def dot_products(xs):
            with kernel_paths(avx512=True, widened_rows=False):
                return block_kernel(xs)

        def widened_rows(xs):
            with kernel_paths(avx512=False, widened_rows=True):
                return block_kernel(xs)

        forms = {
            "int8 dot products": dot_products,
            "fp32 widened rows": widened_rows,
            "torch int4 kernel": lambda xs: [layer(xs[layer.in_features]) for layer in torch_layers],
            "fp32 dense": lambda xs: [xs[w.shape[1]] @ w.t() for w in dense],
            "bf16 dense": bf16_dense,
            f"{'bf16' if widened_dtype() == torch.bfloat16 else 'fp32'} widened per call": widened_per_call,
        }
        rows = []
        for m in map(int, args.rows.split(",")):
            inputs = {layer.in_features: torch.randn(m, layer.in_features) for layer in layers}
            row: dict = {"rows": m}
            timed = [name for name in forms if m >= 4 or forms[name] is not widened_rows]  # the kernel's rows
            for name in timed:
                ms = median_seconds(functools.partial(forms[name], inputs), args.repeats) * 1000
                row[name] = {"ms": sig(ms), "gflops": sig(2 * m * weights / ms / 1e6)}
            row["fastest"] = min(timed, key=lambda name: row[name]["ms"])
            rows.append(row)
    print(json.dumps({"benchmark": "gemm_forms", "machine": machine_info(), "model": engine.loaded.name,
                      "linear_weights": weights, "layers": len(layers), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
