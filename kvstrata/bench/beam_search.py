"""`kvstrata bench beam-search`: beam search against transformers' `generate(num_beams=...)` on the same prompts.

Each of --rounds rounds runs kvstrata's `LLM.beam_search` over every prompt at once (its prefix cache emptied
first, so no round reuses an earlier one's prompts), then transformers' `generate` over the same prompts in one
batch (of equal lengths: no padding), num_beams the same, both to exactly --max-tokens tokens (the model's end
tokens are ignored, so that both run the same number of steps whatever beams they find). Reported per round and as
medians: seconds, the ratio, how many prompts got the same beams from both, and the tokens kvstrata computed
against the fewest a search needs (the prompts once, then one token per beam and step).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvstrata.bench.report import emit, engine_info, machine_info, sig
from kvstrata.bench.transformers_model import transformers_model
from kvstrata.bench.workload import prompts_from_text
from kvstrata.cli.engine_args import engine_config_from_args
from kvstrata.engine.beam_search import BeamSearchParams
from kvstrata.errors import KvstrataError
from kvstrata.llm import LLM


def run_beam_search_bench(args: argparse.Namespace) -> None:
    if args.rounds < 1 or args.prompts < 1:
        raise KvstrataError(f"--rounds and --prompts must be at least 1, got {args.rounds} and {args.prompts}")
    llm = LLM(**vars(engine_config_from_args(args)))
    engine = llm.engine
    prompts = prompts_from_text(engine.tokenizer, args.prompts, args.prompt_len, args.text)
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens, ignore_eos=True)
    hf_model = transformers_model(engine.loaded.source)
    llm.beam_search(prompts[0][:16], BeamSearchParams(beam_width=2, max_tokens=2))  # first calls' one-time costs
    fewest = args.prompts * (args.prompt_len + args.beam_width * (args.max_tokens - 1))
    rounds = []
    for _ in range(args.rounds):
        engine.reset_prefix_cache()
        steps_before = len(engine.step_stats)
        start = time.perf_counter()
        ours = llm.beam_search(prompts, params)
        seconds = time.perf_counter() - start
        steps = list(engine.step_stats)[steps_before:]
        computed = sum(step.prefill_tokens + step.decode_tokens for step in steps)
        theirs, their_seconds = _transformers_beams(hf_model, prompts, params)
        same = sum([list(beam.token_ids) for beam in output.sequences] == beams
                   for output, beams in zip(ours, theirs))
        rounds.append({"kvstrata_s": sig(seconds), "transformers_s": sig(their_seconds),
                       "ratio_to_transformers": sig(their_seconds / seconds), "prompts_with_the_same_beams": same,
                       "kvstrata_steps": len(steps), "kvstrata_tokens_computed": computed,
                       "computed_over_fewest": sig(computed / fewest)})
    report = {
        "benchmark": "beam-search",
        "machine": machine_info(),
        **engine_info(engine),
        "workload": {"prompts": args.prompts, "prompt_len": args.prompt_len, "beam_width": args.beam_width,
                     "max_tokens": args.max_tokens, "text": str(args.text), "threads": torch.get_num_threads(),
                     "rounds": args.rounds},
        "fewest_tokens_computed": fewest,
    }
    for figure in ("kvstrata_s", "transformers_s", "ratio_to_transformers", "computed_over_fewest"):
        report[figure] = sig(statistics.median(one[figure] for one in rounds))
    report["rounds"] = rounds
    emit(report, args.json)


@torch.inference_mode()
def _transformers_beams(model, prompts: list[list[int]], params: BeamSearchParams) -> tuple[list[list[list[int]]],
                                                                                             float]:
    """Each prompt's beams from transformers (best first, output tokens only), and the seconds `generate` took."""
    from transformers import GenerationConfig

    config = GenerationConfig(num_beams=params.beam_width, num_return_sequences=params.beam_width, do_sample=False,
                              max_new_tokens=params.max_tokens, eos_token_id=None, pad_token_id=0)
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    rows = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    seconds = time.perf_counter() - start
    outputs = rows[:, ids.shape[1]:].tolist()
    width = params.beam_width
    return [outputs[i * width : (i + 1) * width] for i in range(len(prompts))], seconds
