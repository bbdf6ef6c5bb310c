"""One layer's decode attention read in place from a paged float32 pool (the compiled kernel of kv/kernels/attend.h,
`paged_decode_attention`), on random K/V of the default model's shape (9 query heads over 3 KV heads of 64):

    .venv/bin/python -m benchmarks.decode_attention --shapes 8x4096,32x320,1x4096 --placement scattered

`--placement in-order` gives each sequence consecutive blocks, as a fresh engine's pool does; `scattered` deals them
out at random over the pool, as a pool that has served many requests of different lengths does. Prints one JSON
document: per shape, the median time of a call, the K/V bytes it reads per second, and its speed against the torch
path on the same pool (what `--no-paged-kernel` runs: each sequence's blocks gathered, then the reference attention),
whose output it must match. To compare two versions of the kernel, run it in each tree, in turn.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvstrata.bench.report import machine_info
from kvstrata.bench.stats import median_seconds
from kvstrata.kv.kernels.paged_decode import kernel
from kvstrata.kv.reference_attention import attend_per_kv_head

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

    def in_place():
        return kernel().paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, HEAD_DIM**-0.5, 0, 0)

    def torch_path():
        k, v = (pool[:, block_tables].flatten(2, 3)[:, :, :context] for pool in (k_pool, v_pool))  # [G, n, T, D]
        return attend_per_kv_head(q[:, None], k, v, torch.ones(1, batch, 1, context, dtype=torch.bool))[:, 0]

    torch.testing.assert_close(in_place(), torch_path(), rtol=1e-4, atol=1e-5)
    seconds, torch_seconds = median_seconds(in_place, repeats), median_seconds(torch_path, repeats)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 4
    return {"batch": batch, "context": context, "ms": round(seconds * 1000, 3),
            "kv_read_gb_per_s": round(kv_bytes / seconds / 1e9, 2), "torch_path_ms": round(torch_seconds * 1000, 3),
            "speedup_vs_torch_path": round(torch_seconds / seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8x4096,32x320,1x4096", help="BATCHxCONTEXT, comma-separated")
    parser.add_argument("--placement", choices=("in-order", "scattered"), default="scattered")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per shape (their median is reported)")
    args = parser.parse_args()
    if kernel() is None:
        raise SystemExit("the compiled KV kernels could not be built: nothing to time")
    try:
        shapes = [(int(batch), int(context)) for batch, context in (shape.split("x") for shape in args.shapes.split(","))]
    except ValueError:
        parser.error(f"--shapes {args.shapes!r}: want BATCHxCONTEXT pairs of whole numbers, e.g. 8x4096,32x320")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    if any(batch < 1 or context < 1 for batch, context in shapes):
        parser.error(f"--shapes {args.shapes!r}: every batch and context must be at least 1")
    rows = [time_shape(batch, context, args.placement == "scattered", args.repeats) for batch, context in shapes]
    print(json.dumps({"benchmark": "decode_attention", "machine": machine_info(), "placement": args.placement,
                      "threads": torch.get_num_threads(), "shapes": rows}, indent=2))


if __name__ == "__main__":
    main()
