"""`kvstrata bench lora`: what serving LoRA adapters costs, and what it gains over running each adapter's merged
weights in transformers (the way to serve several fine-tunes without multi-adapter batching).

--adapters random adapters of --rank on every projection of the model are written to a temporary directory and
loaded. --requests prompts of --prompt-tokens tokens (consecutive windows of Emma) are generated together, greedy
to exactly --max-tokens tokens, three times on one engine: all on the base model, all on one adapter, and request i
on adapter i mod --adapters (every step mixes them). Reported: output tokens/s and the ratio to the base model's.
transformers then runs the base workload in one batch, and the mixed one with each adapter merged into a copy of
the weights, that adapter's requests in one batch (the merges are not timed): its tokens/s, kvstrata's ratio to it,
and how many of kvstrata's outputs equal transformers' (kvstrata runs the GGUF's blocks, transformers their
float32 reading, so outputs part where two tokens are close; the base workload shows how often that happens
without adapters).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch

from kvstrata.bench.lora_adapters import merge_adapter, write_random_adapter
from kvstrata.bench.report import emit, engine_info, machine_info, sig
from kvstrata.bench.transformers_model import transformers_model
from kvstrata.bench.workload import generate_together, prompts_from_text
from kvstrata.cli.engine_args import engine_config_from_args
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.errors import KvstrataError

ADAPTER_STD = 0.02  # of the random A and B: an update of a few percent of the projections' output


def run_lora_bench(args: argparse.Namespace) -> None:
    if min(args.adapters, args.rank, args.requests, args.prompt_tokens, args.max_tokens) < 1:
        raise KvstrataError("--adapters, --rank, --requests, --prompt-tokens and --max-tokens must be at least 1")
    engine = LLMEngine(dataclasses.replace(engine_config_from_args(args, varied=("enable_lora",)), enable_lora=True))
    with tempfile.TemporaryDirectory(prefix="kvstrata-lora-") as root:
        directories = [write_random_adapter(Path(root) / f"adapter{i}", engine.loaded.config, rank=args.rank,
                                            alpha=2 * args.rank, seed=i, std=ADAPTER_STD)
                       for i in range(args.adapters)]
        for i, directory in enumerate(directories):
            engine.load_lora(f"adapter{i}", str(directory))
        prompts = prompts_from_text(engine.tokenizer, args.requests, args.prompt_tokens)
        adapters = {"base": [None] * args.requests, "one_adapter": ["adapter0"] * args.requests,
                    "mixed": [f"adapter{i % args.adapters}" for i in range(args.requests)]}
        generate_together(engine, prompts[:1], [SamplingParams(max_tokens=4, temperature=0.0)])  # one-time costs
        runs = {name: _run(engine, prompts, names, args.max_tokens) for name, names in adapters.items()}
        for one in runs.values():
            one["ratio_to_base"] = sig(one["tokens_per_s"] / runs["base"]["tokens_per_s"])
        report = {"kvstrata": runs}
        if not args.no_transformers:
            theirs = {name: _transformers(engine, directories, prompts, adapters[name], args.max_tokens)
                      for name in ("base", "mixed")}
            for name, one in theirs.items():
                ours = runs[name]
                ours["outputs_equal_to_transformers"] = sum(a == b for a, b in zip(ours["outputs"], one.pop("outputs")))
                ours["ratio_to_transformers"] = sig(ours["tokens_per_s"] / one["tokens_per_s"])
            report["transformers"] = theirs
    for one in runs.values():
        del one["outputs"]
    emit({
        "benchmark": "lora",
        "machine": machine_info(),
        **engine_info(engine),
        "adapter_bytes": engine.lora.adapter("adapter0").nbytes,  # each adapter's (one shape), in --lora-dtype
        "workload": {"adapters": args.adapters, "rank": args.rank, "modules": "all seven projections",
                     "requests": args.requests, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                     "threads": torch.get_num_threads()},
        **report,
    }, args.json)


def _run(engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> dict:
    engine.reset_prefix_cache()
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora_name=adapter)
              for adapter in adapters]
    start = time.perf_counter()
    outputs = generate_together(engine, prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(one) for one in outputs)
    return {"seconds": sig(seconds), "output_tokens": tokens, "tokens_per_s": sig(tokens / seconds),
            "outputs": outputs}


@torch.inference_mode()
def _transformers(engine: LLMEngine, directories: list[Path], prompts: list[list[int]], adapters: list[str | None],
                  max_tokens: int) -> dict:
    """Each adapter's requests (None: the base model's) in one batch (left-padded where lengths differ) on its merged
    weights; seconds of the generate calls only."""
    from transformers import GenerationConfig

    # a GenerationConfig of its own: no end token, so every output runs to max_tokens as kvstrata's (ignore_eos)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
    outputs: dict[int, list[int]] = {}
    seconds = 0.0
    for name, directory in [(None, None), *[(f"adapter{i}", directory) for i, directory in enumerate(directories)]]:
        mine = [i for i, asked in enumerate(adapters) if asked == name]
        if not mine:
            continue
        model = transformers_model(engine.loaded.source)
        if directory is not None:
            merge_adapter(model, directory)
        width = max(len(prompts[i]) for i in mine)
        ids = torch.tensor([[0] * (width - len(prompts[i])) + prompts[i] for i in mine])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in mine])
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, generation_config=config)
        seconds += time.perf_counter() - start
        outputs.update((i, row[width:].tolist()) for i, row in zip(mine, out))
    tokens = sum(len(one) for one in outputs.values())
    return {"seconds": sig(seconds), "output_tokens": tokens, "tokens_per_s": sig(tokens / seconds),
            "outputs": [outputs[i] for i in range(len(prompts))]}
