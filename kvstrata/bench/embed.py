"""`kvstrata bench embed`: embeddings (`LLM.embed`'s path) against transformers' forward pass over the same texts.

Two workloads of --texts texts each, cut from --text with a fixed seed: `distinct`, windows of --length tokens (a
number or a distribution, as `bench throughput` takes them) at random places; `shared_prefix`, one passage of
--prefix-tokens tokens (an instruction or a document's head) followed by each text's own window of --suffix-tokens.
kvstrata embeds a workload's texts together, its prefix cache emptied first; transformers (the same weights in
float32, `model.model`'s last_hidden_state) runs them in batches of --hf-batch-size, longest first as
sentence-transformers orders them (so a batch pads little), left-padded, and takes the last position's state,
normalized as kvstrata normalizes it. Reported per workload: texts/s and prompt tokens/s of each,
kvstrata's ratio to transformers, the prompt tokens kvstrata computed (the rest came from its prefix cache), and the
lowest cosine similarity between the two engines' embeddings of a text (kvstrata runs the GGUF's blocks, transformers
their float32 reading: the tests check equality on float32 weights).
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

from kvstrata.bench.report import emit, engine_info, machine_info, sig
from kvstrata.bench.transformers_model import transformers_model
from kvstrata.bench.workload import parse_length, read_text, run_together
from kvstrata.cli.engine_args import engine_config_from_args
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.pooling_params import PoolingParams
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.errors import KvstrataError

SEED = 11


def run_embed_bench(args: argparse.Namespace) -> None:
    if min(args.texts, args.prefix_tokens, args.suffix_tokens, args.hf_batch_size) < 1:
        raise KvstrataError("--texts, --prefix-tokens, --suffix-tokens and --hf-batch-size must be at least 1")
    engine = LLMEngine(engine_config_from_args(args))
    workloads = _workloads(engine, args)
    _embed(engine, workloads["distinct"][:2])  # one-time costs before anything is timed
    model = None if args.no_transformers else transformers_model(engine.loaded.source)
    report = {}
    for name, texts in workloads.items():
        ours = _embed(engine, texts)
        row = {"texts": len(texts), "prompt_tokens": sum(map(len, texts)), "kvstrata": ours["figures"]}
        if model is not None:
            theirs = _transformers(model, texts, args.hf_batch_size)
            row["transformers"] = theirs["figures"]
            row["ratio_to_transformers"] = sig(ours["figures"]["texts_per_s"] / theirs["figures"]["texts_per_s"])
            row["min_cosine_to_transformers"] = sig(min(
                float(a @ b) for a, b in zip(ours["embeddings"], theirs["embeddings"])))
        report[name] = row
    emit({
        "benchmark": "embed",
        "machine": machine_info(),
        **engine_info(engine),
        "workload": {"texts": args.texts, "length": args.length, "prefix_tokens": args.prefix_tokens,
                     "suffix_tokens": args.suffix_tokens, "hf_batch_size": args.hf_batch_size, "seed": SEED,
                     "threads": torch.get_num_threads()},
        **report,
    }, args.json)


def _workloads(engine: LLMEngine, args: argparse.Namespace) -> dict[str, list[list[int]]]:
    ids = engine.tokenizer.encode(read_text(args.text))
    rng = random.Random(SEED)
    length = parse_length(args.length, "length")

    def window(size: int) -> list[int]:
        if size >= len(ids):
            raise KvstrataError(f"{args.text} has {len(ids)} tokens, too few for a {size}-token text")
        start = rng.randrange(len(ids) - size)
        return ids[start : start + size]

    prefix = window(args.prefix_tokens)
    return {"distinct": [window(length(rng)) for _ in range(args.texts)],
            "shared_prefix": [prefix + window(args.suffix_tokens) for _ in range(args.texts)]}


def _embed(engine: LLMEngine, texts: list[list[int]]) -> dict:
    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=1, pooling=PoolingParams())
    engine.step_stats.clear()
    start = time.perf_counter()
    outputs = run_together(engine, texts, [params] * len(texts))
    seconds = time.perf_counter() - start
    computed = sum(s.prefill_tokens for s in engine.step_stats)
    return {"figures": _rates(texts, seconds) | {"computed_tokens": computed},
            "embeddings": [output.embedding for output in outputs]}


@torch.inference_mode()
def _transformers(model, texts: list[list[int]], batch_size: int) -> dict:
    embeddings = {}
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    start = time.perf_counter()
    for first in range(0, len(texts), batch_size):
        chosen = order[first : first + batch_size]
        batch = [texts[i] for i in chosen]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(t)) + t for t in batch])
        mask = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for t in batch])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        states = model.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        embeddings.update(zip(chosen, F.normalize(states[:, -1].float(), dim=-1)))
    return {"figures": _rates(texts, time.perf_counter() - start),
            "embeddings": [embeddings[i] for i in range(len(texts))]}


def _rates(texts: list[list[int]], seconds: float) -> dict:
    return {"seconds": sig(seconds), "texts_per_s": sig(len(texts) / seconds),
            "prompt_tokens_per_s": sig(sum(map(len, texts)) / seconds)}
