"""`kvstrata bench sarathi`: the SARATHI paper's measurements (papers/sarathi.md §4) on this machine.

- `per_token_cost` (Fig. 3): prefill and decode cost per token as the batch grows.
- `piggyback` (Table 2): marginal cost of a decode riding along a prefill chunk, by the paper's
  method [t(chunk + d decodes) - t(chunk alone)] / d, against a decode-only step's cost per token.
- `pd_sweep` (Fig. 9): total throughput against the prefill:decode ratio with the batch capped by
  the KV budget, sarathi at several chunk sizes against prefill-first and static.
- `chunk_overhead` (Fig. 13): prefill time of one prompt in chunks of C against one piece.
"""

from __future__ import annotations

import dataclasses
import random

import torch
from tqdm import tqdm

from kvstrata.bench.report import sig
from kvstrata.bench.roofline import measure_concurrent_rate
from kvstrata.bench.step_timer import StepTimer
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.kv.paged_cache import PagedKVCache
from kvstrata.model.loader import LoadedModel


def _tokens(source: list[int], length: int, rng: random.Random) -> list[int]:
    start = rng.randrange(len(source) - length)
    return source[start : start + length]


def per_token_cost(engine: LLMEngine, source: list[int], batches: list[int], prompt_len: int,
                   context: int) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for batch in tqdm(batches, desc="per-token cost", leave=False):
        timer = StepTimer(engine)
        prefills = [timer.sequence(_tokens(source, prompt_len, rng), cached=0) for _ in range(batch)]
        prefill = timer.time([(s, prompt_len) for s in prefills])
        timer.release()
        decodes = [timer.sequence(_tokens(source, context + 1, rng), cached=context) for _ in range(batch)]
        decode = timer.time([(s, 1) for s in decodes])
        timer.release()
        rows.append({
            "batch": batch,
            "prefill_ms_per_token": round(prefill * 1000 / (batch * prompt_len), 4),
            "decode_ms_per_token": round(decode * 1000 / batch, 4),
            "decode_to_prefill_cost": round((decode / batch) / (prefill / (batch * prompt_len)), 1),
        })
    return rows


def piggyback(engine: LLMEngine, source: list[int], chunk: int, decodes: list[int], context: int) -> list[dict]:
    rng = random.Random(1)
    rows = []
    for d in tqdm(decodes, desc="piggyback", leave=False):
        timer = StepTimer(engine)
        prompt = timer.sequence(_tokens(source, chunk, rng), cached=0)
        riders = [timer.sequence(_tokens(source, context + 1, rng), cached=context) for _ in range(d)]
        prefill_tokens = chunk - d  # the fused step keeps C tokens in all, as the paper does
        alone = timer.time([(prompt, prefill_tokens)])
        mixed = timer.time([(s, 1) for s in riders] + [(prompt, prefill_tokens)])
        decode_only = timer.time([(s, 1) for s in riders])
        timer.release()
        marginal = (mixed - alone) / d
        rows.append({
            "decodes": d,
            "prefill_tokens": prefill_tokens,
            "prefill_only_ms": round(alone * 1000, 2),
            "decode_maximal_ms": round(mixed * 1000, 2),
            "decode_only_ms": round(decode_only * 1000, 2),
            "decode_only_ms_per_token": round(decode_only * 1000 / d, 3),
            "piggybacked_ms_per_decode": round(marginal * 1000, 3),
            # None when the marginal time is lost in the step's noise (zero or negative)
            "decode_speedup": round((decode_only / d) / marginal, 2) if marginal > 0 else None,
        })
    return rows


def chunk_overhead(engine: LLMEngine, source: list[int], prompt_len: int, chunks: list[int]) -> list[dict]:
    rng = random.Random(2)
    prompt = _tokens(source, prompt_len, rng)
    timer = StepTimer(engine)
    seq = timer.sequence(prompt, cached=0)
    rows = []
    for chunk in tqdm(chunks, desc="chunk overhead", leave=False):
        total = 0.0
        for start in range(0, prompt_len, chunk):
            seq.num_computed_tokens = start
            total += timer.time([(seq, min(chunk, prompt_len - start))], repeats=3)
        seq.num_computed_tokens = 0
        rows.append({"chunk_size": chunk, "prefill_ms": round(total * 1000, 2)})
    timer.release()
    whole = next((r["prefill_ms"] for r in rows if r["chunk_size"] >= prompt_len), rows[-1]["prefill_ms"])
    for r in rows:
        r["slowdown_vs_one_piece"] = sig(r["prefill_ms"] / whole)
    return rows


def pd_sweep(base: EngineConfig, loaded: LoadedModel, source: list[int], seq_len: int, batch: int,
             requests: int, ratios: list[float], chunks: list[int]) -> list[dict]:
    """Throughput per P:D with KV memory for exactly `batch` requests of `seq_len` tokens."""
    mc = loaded.config
    per_token = PagedKVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, getattr(torch, base.dtype))
    blocks = batch * -(-seq_len // base.block_size)
    capped = dataclasses.replace(
        base, kv_cache_memory=blocks * base.block_size * per_token, max_model_len=seq_len, max_num_seqs=batch,
        enable_prefix_caching=False,
    )
    policies = [("sarathi", c) for c in chunks] + [("prefill-first", None), ("static", None)]
    rng = random.Random(3)
    rows = []
    for ratio in tqdm(ratios, desc="P:D sweep", leave=False):
        output_len = max(1, round(seq_len / (ratio + 1)))
        prompt_len = seq_len - output_len
        prompts = [_tokens(source, prompt_len, rng) for _ in range(requests)]
        row = {"pd_ratio": round(prompt_len / output_len, 2), "prompt_len": prompt_len, "output_len": output_len}
        for scheduler, chunk in policies:
            config = dataclasses.replace(capped, scheduler=scheduler, chunk_size=chunk or capped.chunk_size)
            rate = measure_concurrent_rate(LLMEngine(config, loaded=loaded), prompts, output_len)
            row[f"{scheduler}{'' if chunk is None else f'_c{chunk}'}_tokens_per_s"] = round(rate, 2)
        sarathi_best = max(v for k, v in row.items() if k.startswith("sarathi_c"))
        row["sarathi_best_vs_prefill_first"] = sig(sarathi_best / row["prefill-first_tokens_per_s"])
        row["sarathi_best_vs_static"] = sig(sarathi_best / row["static_tokens_per_s"])
        rows.append(row)
    return rows
