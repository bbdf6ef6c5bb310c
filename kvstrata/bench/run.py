"""Run the engine benchmarks and report them."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from kvstrata.bench import plots, sarathi
from kvstrata.bench.decode import (
    agreement,
    gguf_file,
    llama_cpp_decoder,
    package_version,
    transformers_decoder,
)
from kvstrata.bench.flag_lists import positive_ints
from kvstrata.bench.machine_limits import gemm_gflops, gemv_bandwidth_gbs, read_bandwidth_gbs
from kvstrata.bench.report import emit, engine_info, machine_info, sig
from kvstrata.bench.roofline import (
    decode_read_bytes,
    decode_step_seconds,
    flops_per_token,
    measure_concurrent_rate,
    measure_decode_step,
    measure_prefill_rate,
    resident_weight_bytes,
    workload_flops,
)
from kvstrata.bench.step_split import step_split_ms, timed_model_calls
from kvstrata.bench.throughput import run_kvstrata, run_transformers
from kvstrata.bench.workload import parse_length, prompts_from_text, read_text, sample_requests
from kvstrata.cli.engine_args import engine_config_from_args
from kvstrata.config import SCHEDULERS, EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.errors import KvstrataError
from kvstrata.model import block_linear


def run_roofline(args: argparse.Namespace) -> None:
    # No prefix caching: the prompts below overlap, and a hit would flatter the prefill rate.
    engine = LLMEngine(dataclasses.replace(engine_config_from_args(args), enable_prefix_caching=False))
    model, config = engine.loaded.model, engine.loaded.config
    gemm_rates = {"fp32": gemm_gflops(engine.device)}
    if (block_linear.widened_dtype() == torch.bfloat16
            and any(isinstance(m, block_linear.BlockLinear) for m in model.modules())):
        gemm_rates["bf16"] = gemm_gflops(engine.device, dtype=torch.bfloat16)  # prefill-sized products over blocks
    gflops = max(gemm_rates.values())  # the limit: the fastest GEMM the engine's products may run on
    bandwidth = read_bandwidth_gbs(engine.device)
    gemv_bandwidth = gemv_bandwidth_gbs(engine.device)
    params_bytes = decode_read_bytes(model)

    decode_prompt = prompts_from_text(engine.tokenizer, 1, args.decode_context, args.text)[0]
    decode_step, _ = measure_decode_step(engine, decode_prompt, args.decode_steps)
    decode_limit = params_bytes / (bandwidth * 1e9)
    decode_flops = flops_per_token(model, config, args.decode_context, with_logits=True)

    prefill_prompts = prompts_from_text(engine.tokenizer, 3, args.prompt_len, args.text)
    prefill_rate = measure_prefill_rate(engine, prefill_prompts)
    prefill_flops = flops_per_token(model, config, args.prompt_len // 2, with_logits=False)  # mean context
    prefill_limit = gflops * 1e9 / prefill_flops

    report = {
        "benchmark": "roofline",
        "machine": machine_info(),
        **engine_info(engine),
        "workload": {"prompt_len": args.prompt_len, "decode_context": args.decode_context,
                     "decode_steps": args.decode_steps, "concurrent": args.concurrent,
                     "concurrent_prompt_len": args.concurrent_prompt_len,
                     "concurrent_output_len": args.concurrent_output_len, "text": str(args.text)},
        "gemm_gflops": sig(gflops),
        "gemm_gflops_by_dtype": {name: sig(rate) for name, rate in gemm_rates.items()},
        "read_bandwidth_gbs": sig(bandwidth),
        "gemv_bandwidth_gbs": sig(gemv_bandwidth),
        "decode_read_bytes": params_bytes,
        "resident_weight_bytes": resident_weight_bytes(model),
        "flops_per_token_decode": round(decode_flops),
        "flops_per_token_prefill": round(prefill_flops),
        "decode_step_limit_ms": sig(decode_limit * 1000),
        "decode_step_ms": sig(decode_step * 1000),
        "decode_fraction": sig(decode_limit / decode_step),
        "decode_fraction_of_gemv_bandwidth": sig(params_bytes / (gemv_bandwidth * 1e9) / decode_step),
        "prefill_limit_tokens_per_s": sig(prefill_limit),
        "prefill_tokens_per_s": sig(prefill_rate),
        "prefill_fraction": sig(prefill_rate / prefill_limit),
    }
    if args.concurrent:
        prompts = prompts_from_text(engine.tokenizer, args.concurrent, args.concurrent_prompt_len, args.text)
        rate = measure_concurrent_rate(engine, prompts, args.concurrent_output_len)
        tokens = args.concurrent * (args.concurrent_prompt_len + args.concurrent_output_len)
        flops = workload_flops(model, config, args.concurrent, args.concurrent_prompt_len, args.concurrent_output_len)
        limit = gflops * 1e9 / (flops / tokens)
        report.update({
            "flops_per_token_concurrent": round(flops / tokens),
            "concurrent_limit_tokens_per_s": sig(limit),
            "concurrent_tokens_per_s": sig(rate),
            "concurrent_fraction": sig(rate / limit),
        })
    if args.plot:
        plots.roofline(report, args.plot)
    emit(report, args.json)


def run_decode(args: argparse.Namespace) -> None:
    if args.rounds < 1:
        raise KvstrataError(f"--rounds must be at least 1, got {args.rounds}")
    engine = LLMEngine(dataclasses.replace(engine_config_from_args(args), enable_prefix_caching=False))
    gguf_path = gguf_file(engine.loaded.source)
    prompt = prompts_from_text(engine.tokenizer, 1, args.context, args.text)[0]
    warmup_start = time.perf_counter()  # a short run first: under --compile it pays the compile
    measure_decode_step(engine, prompt, 8)
    warmup = time.perf_counter() - warmup_start
    baselines = {}
    if not args.no_llama_cpp:
        baselines["llama_cpp"] = llama_cpp_decoder(gguf_path, prompt, args.steps, torch.get_num_threads())
    if not args.no_transformers:
        baselines["transformers"] = transformers_decoder(gguf_path, prompt, args.steps)
    # Each round times kvstrata then every baseline, back to back: this machine's speed drifts between runs of a
    # few seconds, so a ratio compares runs of one round, and the report gives each round and their medians
    # (kvstrata's own rate and step split: over the decode steps of every round).
    rounds, steps = [], []
    with timed_model_calls(engine.loaded.model) as call_times:
        for _ in range(args.rounds):
            round_steps, tokens = decode_step_seconds(engine, prompt, args.steps)
            steps += round_steps
            seconds = statistics.median(round_steps)
            one = {"kvstrata_tokens_per_s": sig(1 / seconds)}
            for name, decode in baselines.items():
                if decode is None:
                    continue  # not installed
                try:
                    theirs, their_tokens = decode()
                except KvstrataError as failure:  # a baseline that fails in one round is reported, not fatal
                    one[f"{name}_error"] = str(failure)
                    continue
                one |= {f"{name}_tokens_per_s": sig(1 / theirs), f"ratio_to_{name}": sig(theirs / seconds),
                        f"greedy_agreement_with_{name}": sig(agreement(tokens, their_tokens))}
            rounds.append(one)
    seconds = statistics.median(steps)
    report = {
        "benchmark": "decode",
        "machine": machine_info(),
        **engine_info(engine),
        "workload": {"context": args.context, "steps": args.steps, "text": str(args.text),
                     "threads": torch.get_num_threads(), "rounds": args.rounds},
        "decode_read_bytes": decode_read_bytes(engine.loaded.model),
        "resident_weight_bytes": resident_weight_bytes(engine.loaded.model),
        "kvstrata_warmup_s": sig(warmup),
        "kvstrata_tokens_per_s": sig(1 / seconds),
        "kvstrata_step_split_ms": {part: sig(ms) for part, ms in step_split_ms(seconds, call_times).items()},
    }
    if "llama_cpp" in baselines:
        report["llama_cpp_version"] = package_version("llama-cpp-python")
    for name in baselines:
        for figure in (f"{name}_tokens_per_s", f"ratio_to_{name}", f"greedy_agreement_with_{name}"):
            values = [one[figure] for one in rounds if figure in one]
            report[figure] = sig(statistics.median(values)) if values else None  # not installed, or failed
    report["rounds"] = rounds
    emit(report, args.json)


def run_throughput(args: argparse.Namespace) -> None:
    base = engine_config_from_args(args, varied=("scheduler",))
    schedulers = [s for s in args.schedulers.split(",") if s]
    for scheduler in schedulers:
        if scheduler not in SCHEDULERS:
            raise KvstrataError(f"--schedulers: {scheduler!r} is not one of {', '.join(SCHEDULERS)}")
    if args.requests < 1:
        raise KvstrataError(f"--requests must be at least 1, got {args.requests}")
    probe = LLMEngine(base)
    loaded = probe.loaded
    requests = sample_requests(
        probe.tokenizer, args.requests, parse_length(args.prompt_len, "prompt-len"),
        parse_length(args.output_len, "output-len"), args.text, args.seed,
    )
    del probe
    results = []
    for scheduler in schedulers:
        config = dataclasses.replace(base, scheduler=scheduler)
        results.append({"system": "kvstrata", "scheduler": scheduler, **run_kvstrata(config, loaded, requests)})
    if not args.no_transformers:
        batch = args.hf_batch_size or len(requests)
        results.append({"system": "transformers", "batch_size": batch, **run_transformers(loaded, requests, batch)})
    rate = {r.get("scheduler", r["system"]): r["total_tokens_per_s"] for r in results}
    ratios = {f"{s}_vs_transformers": sig(rate[s] / rate["transformers"]) for s in schedulers
              if "transformers" in rate}
    ratios.update({f"sarathi_vs_{s}": sig(rate["sarathi"] / rate[s]) for s in schedulers
                   if "sarathi" in rate and s != "sarathi"})
    report = {
        "benchmark": "throughput",
        "machine": machine_info(),
        "model": loaded.name,
        "config": dataclasses.asdict(base),
        "workload": {"requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
                     "text": str(args.text), "seed": args.seed,
                     "prompt_tokens": sum(len(p) for p, _ in requests),
                     "output_tokens": sum(n for _, n in requests)},
        "results": results,
        "ratios": ratios,
    }
    if "transformers" in rate:
        best = max(schedulers, key=lambda s: rate[s])
        report["speedup_vs_transformers"] = sig(rate[best] / rate["transformers"])
    if args.plot:
        plots.throughput(results, args.plot)
    emit(report, args.json)


def run_sarathi(args: argparse.Namespace) -> None:
    base = engine_config_from_args(args, varied=("scheduler",))
    parts = [p for p in args.only.split(",") if p]
    known = ("per_token_cost", "piggyback", "pd_sweep", "chunk_overhead")
    if unknown := [p for p in parts if p not in known]:
        raise KvstrataError(f"--only: {unknown[0]!r} is not one of {', '.join(known)}")
    engine = LLMEngine(dataclasses.replace(base, enable_prefix_caching=False))
    source = engine.tokenize(read_text(args.text))
    report = {"benchmark": "sarathi", "machine": machine_info(), **engine_info(engine), "workload": command_flags(args)}
    if "per_token_cost" in parts:
        report["per_token_cost"] = sarathi.per_token_cost(
            engine, source, positive_ints(args.batches, "batches"), args.prompt_len, args.context
        )
    if "piggyback" in parts:
        report["piggyback"] = sarathi.piggyback(
            engine, source, args.chunk, positive_ints(args.decodes, "decodes"), args.context
        )
    if "chunk_overhead" in parts:
        report["chunk_overhead"] = sarathi.chunk_overhead(
            engine, source, args.overhead_prompt_len, positive_ints(args.overhead_chunks, "overhead-chunks")
        )
    if "pd_sweep" in parts:
        ratios = [float(r) for r in args.ratios.split(",") if r]
        chunks = positive_ints(args.chunks, "chunks")
        report["pd_sweep"] = sarathi.pd_sweep(base, engine.loaded, source, args.seq_len, args.batch, args.requests,
                                              ratios, chunks)
        report["pd_sweep_predicted_peak"] = {c: round(c / (args.batch - 1), 1) if args.batch > 1 else None
                                             for c in chunks}
    if args.plot:
        plots.sarathi(report, args.plot)
    emit(report, args.json)


def command_flags(args: argparse.Namespace) -> dict:
    """The command's own flags, for the report (engine flags are in `config`)."""
    engine_flags = set(EngineConfig.field_names())
    return {k: (str(v) if k == "text" else v) for k, v in vars(args).items()
            if k not in engine_flags and k not in ("command", "bench", "json", "plot")}
