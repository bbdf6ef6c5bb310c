"""`kvstrata bench speculative`: speculative decoding by prompt lookup against plain decoding and against
transformers' `generate(prompt_lookup_num_tokens=...)`, one request at a time (the latency it is for), or --batch
requests at once (what drafts cost a batch).

Each task is a chat request about a passage of --text: `rewrite` (correct it and write it out: the output copies the
passage), `extract` (quote the sentences that answer a question), `free` (write freely from it: little to copy but
what the output repeats of itself). Every engine (plain, then one per --speculative-tokens value; the weights loaded
once) runs the task's prompts, --batch at a time, greedy, to --max-tokens tokens or the model's end. Reported per
task: output tokens/s, the ratio to plain decoding, the drafts verified and accepted, and how many outputs equal plain
decoding's (under --kv-offload also the KV bytes copied from the host pool per output token, and the --kv-link model's
seconds for them: modeled); transformers' tokens/s with and without prompt lookup (the largest --speculative-tokens
value, --prompt-lookup-max as its longest n-gram) and kvstrata's best ratio to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from kvstrata.bench.flag_lists import positive_ints
from kvstrata.bench.report import emit, engine_info, machine_info, sig
from kvstrata.bench.transformers_model import transformers_model
from kvstrata.bench.workload import generate_together, read_text, take_turns
from kvstrata.cli.engine_args import engine_config_from_args
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.errors import KvstrataError

TASKS = {
    "rewrite": "Correct any spelling mistakes in the following text and write it out in full.\n\n{}",
    "extract": "Which sentences of the following text say what it is about? Quote them.\n\n{}",
    "free": "Write a short story inspired by this text.\n\n{}",
}


def run_speculative_bench(args: argparse.Namespace) -> None:
    counts = positive_ints(args.speculative_tokens, "speculative-tokens")
    unknown = [task for task in args.tasks.split(",") if task not in TASKS]
    if unknown or min(args.prompts, args.max_tokens, args.batch, args.rounds) < 1:
        raise KvstrataError(f"--tasks takes {', '.join(TASKS)} (got {args.tasks!r}); --prompts, --max-tokens, "
                            f"--batch and --rounds must be at least 1")
    config = engine_config_from_args(args, varied=("num_speculative_tokens",))
    plain = LLMEngine(dataclasses.replace(config, num_speculative_tokens=0))
    engines = {0: plain} | {k: LLMEngine(dataclasses.replace(config, num_speculative_tokens=k), plain.loaded)
                            for k in counts}
    passages = _passages(read_text(args.text), args.prompts, args.skip_passages)
    # transformers' prompt lookup takes one sequence at a time
    hf_model = None if args.no_transformers or args.batch > 1 else transformers_model(plain.loaded.source)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for engine in engines.values():  # first calls' one-time costs
        _generate(engine, [plain.tokenizer.encode("Hello")], SamplingParams(max_tokens=4, temperature=0.0), 1)
    tasks = {}
    for task in args.tasks.split(","):
        prompts = [plain.tokenizer.encode_chat([{"role": "user", "content": TASKS[task].format(p)}],
                                               add_generation_prompt=True) for p in passages]
        runs = _rounds(engines, prompts, params, args.batch, args.rounds)
        expected = runs[0].pop("outputs")
        for k, one in list(runs.items())[1:]:
            one["outputs_equal_to_plain"] = sum(a == b for a, b in zip(one.pop("outputs"), expected))
            one["ratio_to_plain"] = sig(one["tokens_per_s"] / runs[0]["tokens_per_s"])
        result = {"kvstrata": {("plain" if k == 0 else f"speculative_{k}"): one for k, one in runs.items()}}
        if hf_model is not None:
            theirs = _transformers(hf_model, prompts, args.max_tokens, max(counts), config.prompt_lookup_max)
            best = max(one["tokens_per_s"] for one in runs.values())
            result["transformers"] = theirs
            result["best_ratio_to_transformers_prompt_lookup"] = sig(best / theirs["prompt_lookup"]["tokens_per_s"])
        tasks[task] = result
    emit({
        "benchmark": "speculative",
        "machine": machine_info(),
        **engine_info(plain),
        "workload": {"text": str(args.text), "prompts": args.prompts, "skip_passages": args.skip_passages,
                     "max_tokens": args.max_tokens, "batch": args.batch, "rounds": args.rounds,
                     "speculative_tokens": counts,
                     "threads": torch.get_num_threads()},
        "tasks": tasks,
    }, args.json)


def _passages(text: str, count: int, skip: int) -> list[str]:
    """`count` paragraphs of 300-700 characters, after the first `skip` such."""
    paragraphs = [p.strip() for p in text.split("\n\n") if 300 <= len(p.strip()) <= 700][skip : skip + count]
    if len(paragraphs) < count:
        raise KvstrataError(f"the text has {len(paragraphs)} paragraphs of 300-700 characters after {skip}, fewer "
                            f"than --prompts {count}")
    return paragraphs


def _generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, batch: int) -> list[list[int]]:
    """Each prompt's output tokens, `batch` requests at a time (each group sent together and run to its end)."""
    return [tokens for first in range(0, len(prompts), batch)
            for tokens in generate_together(engine, prompts[first : first + batch], [params] * batch)]


def _rounds(engines: dict[int, LLMEngine], prompts: list[list[int]], params: SamplingParams, batch: int,
            rounds: int) -> dict[int, dict]:
    """Each engine's runs of the prompts, every engine once a round in an order reversed each round (so the
    machine's drift falls on all alike): seconds, tokens, steps and drafts summed over the rounds, the first
    round's outputs."""
    runs = take_turns(engines, rounds, lambda engine: _run(engine, prompts, params, batch), alternate=True)
    return {k: _rates(_summed(one)) for k, one in runs.items()}


def _summed(runs: list[dict]) -> dict:
    """The first run, its seconds and counts summed over all the runs."""
    first, *others = runs
    keys = [key for key in ("seconds", "output_tokens", "steps", "draft_tokens", "accepted_tokens", *OFFLOAD_KEYS)
            if key in first]
    return {**first, **{key: first[key] + sum(one[key] for one in others) for key in keys}}


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, batch: int) -> dict:
    """One run of the prompts; under --kv-offload also the KV bytes copied from the host pool and the link model's
    time for them (modeled)."""
    engine.reset_prefix_cache()
    engine.step_stats.clear()
    offload = getattr(engine.attention, "stats", None)
    before = _offload_counts(offload)
    start = time.perf_counter()
    outputs = _generate(engine, prompts, params, batch)
    seconds = time.perf_counter() - start
    moved = {key: after - before[key] for key, after in _offload_counts(offload).items()}
    return {"seconds": seconds, "output_tokens": sum(len(one) for one in outputs), "steps": len(engine.step_stats),
            "draft_tokens": sum(step.num_draft_tokens for step in engine.step_stats),
            "accepted_tokens": sum(step.num_accepted_tokens for step in engine.step_stats), **moved,
            "outputs": outputs}


OFFLOAD_KEYS = ("kv_copied_bytes", "modeled_transfer_s")


def _offload_counts(stats) -> dict:
    if stats is None:
        return {}
    return dict(zip(OFFLOAD_KEYS, (int(stats.copied_bytes.sum()), float(stats.modeled_transfer_s.sum()))))


def _rates(run: dict) -> dict:
    drafted, accepted, tokens = run["draft_tokens"], run["accepted_tokens"], run["output_tokens"]
    per_token = {f"{key}_per_token": sig(run[key] / tokens) for key in OFFLOAD_KEYS if key in run}
    return {**run, "seconds": sig(run["seconds"]), "tokens_per_s": sig(tokens / run["seconds"]),
            "acceptance": sig(accepted / drafted) if drafted else None, **per_token}


@torch.inference_mode()
def _transformers(model, prompts: list[list[int]], max_tokens: int, lookup_tokens: int, lookup_max: int) -> dict:
    """transformers' greedy tokens/s over the prompts one at a time, plain and with prompt lookup."""
    from transformers import GenerationConfig

    runs = {}
    for name, lookup in (("plain", {}), ("prompt_lookup", {"prompt_lookup_num_tokens": lookup_tokens,
                                                          "max_matching_ngram_size": lookup_max})):
        config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, pad_token_id=0,
                                  eos_token_id=model.generation_config.eos_token_id, **lookup)
        tokens, start = 0, time.perf_counter()
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            tokens += out.shape[1] - ids.shape[1]
        seconds = time.perf_counter() - start
        runs[name] = {"seconds": sig(seconds), "output_tokens": tokens, "tokens_per_s": sig(tokens / seconds)}
    runs["prompt_lookup_ratio_to_plain"] = sig(runs["prompt_lookup"]["tokens_per_s"] / runs["plain"]["tokens_per_s"])
    return runs
