"""One layer's decode attention read in place from a paged float32 pool (the compiled kernel of kv/kernels/attend.h,
`paged_decode_attention`), on random K/V of the default model's shape (9 query heads over 3 KV heads of 64):

    .venv/bin/python -m benchmarks.decode_attention --shapes 8x4096,32x320,1x4096 --placement scattered

`--placement in-order` gives each sequence consecutive blocks, as a fresh engine's pool does; `scattered` deals them
out at random over the pool, as a pool that has served many requests of different lengths does. Prints one JSON
document: per shape, the median time of a call and the K/V bytes it reads per second. Timings only, no ratio: run it
in the trees to compare, in turn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvstrata.bench.report import machine_info
from kvstrata.kv.kernels.paged_decode import kernel

KV_HEADS, QUERY_HEADS, HEAD_DIM, BLOCK = 3, 9, 64, 16


def time_shape(batch: int, context: int, scattered: bool, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    blocks_per_sequence = -(-context // BLOCK)
    num_blocks = batch * blocks_per_sequence
    k_pool, v_pool = (torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM, generator=generator) for _ in range(2))
    order = torch.randperm(num_blocks, generator=generator) if scattered else torch.arange(num_blocks)
    block_tables = order.view(batch, blocks_per_sequence)
    context_lens = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, QUERY_HEADS, HEAD_DIM, generator=generator)
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        start = time.perf_counter()
        kernel().paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, HEAD_DIM**-0.5, 0, 0)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:])
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 4
    return {"batch": batch, "context": context, "ms": round(seconds * 1000, 3),
            "kv_read_gb_per_s": round(kv_bytes / seconds / 1e9, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8x4096,32x320,1x4096", help="BATCHxCONTEXT, comma-separated")
    parser.add_argument("--placement", choices=("in-order", "scattered"), default="scattered")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per shape (their median is reported)")
    args = parser.parse_args()
    if kernel() is None:
        raise SystemExit("the compiled KV kernels could not be built: nothing to time")
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    rows = [time_shape(batch, context, args.placement == "scattered", args.repeats) for batch, context in shapes]
    print(json.dumps({"benchmark": "decode_attention", "machine": machine_info(), "placement": args.placement,
                      "threads": torch.get_num_threads(), "shapes": rows}, indent=2))


if __name__ == "__main__":
    main()
