"""`kvstrata bench offload`: decode speed with the KV cache in a host pool, `full` (FlexGen-style) against
`infinigen` against `none` (KV on the compute device), over context lengths and batch sizes
(papers/infinigen.md Figs. 14-16).

For each context length one real prefill of that much text gives the K/V; every sequence of a batch starts from it
as preloaded KV (the same text, its own blocks), so the KV each mode reads is real text's and no batch pays its
prefill. Each mode then decodes `steps` tokens per sequence; a step's time is the median over them.

Measured: tokens/s on this machine; on a CPU host pool and device are both main memory and the copy is a memcpy
(a float pool's whole blocks copied into the device buffer; InfiniGen's speculated rows are gathered into it, host
work that is not counted as copying), with `--device cuda` the copies cross the machine's real link to the GPU.
Modeled (labelled so, on a CPU only): the step with the measured copy time replaced by the link model's time for the
bytes the step moved in the host pool's format, over PCIe 3 and 4, with no overlap of copy and compute (an upper
bound; InfiniGen overlaps its fetch with the previous layer).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time

import torch

from kvstrata.bench.report import sig
from kvstrata.engine.direct_forward import compute_kv
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.errors import KvstrataError
from kvstrata.kv.offload.link import parse_link
from kvstrata.kv.preloaded import PreloadedKV

MODES = ("none", "full", "infinigen")
MODELED_LINKS = ("pcie3", "pcie4")


def measure_mode(config, loaded, kv: PreloadedKV, prompt: list[int], batch: int, steps: int) -> dict:
    """Decode `steps` tokens for `batch` sequences that start from `kv`; the median step and what it moved."""
    engine = LLMEngine(config, loaded=loaded)
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(prompt, params, preloaded=[kv])
    engine.step()  # places the preloaded KV, prefills each prompt's last token, samples the first output
    stats = getattr(engine.attention, "stats", None)
    before = _snapshot(stats)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    moved = {name: (value - before[name]) / len(times) for name, value in _snapshot(stats).items()}
    step = statistics.median(times)
    result = {"step_s": round(step, 5), "tokens_per_s": round(batch / step, 2)}
    if stats is not None:
        result.update(stored_form_bytes_per_step=round(moved["stored_form_bytes"]),
                      copy_s_per_step=round(moved["copy_seconds"], 5),
                      fraction_fetched=round(moved["fetched_rows"] / max(moved["cached_rows"], 1), 4))
        # on a GPU the copies cross the real link: the measured step is the figure
        for name in MODELED_LINKS if config.device == "cpu" else ():
            link = parse_link(name)
            transfer = moved["stored_form_bytes"] / link.bytes_per_second + moved["transfers"] * link.latency_s
            result[f"modeled_{name}_step_s"] = round(step - moved["copy_seconds"] + transfer, 5)
    del engine
    gc.collect()
    return result


def _snapshot(stats) -> dict:
    if stats is None:
        return {}
    return {"stored_form_bytes": int(stats.stored_form_bytes.sum()), "copy_seconds": stats.copy_seconds,
            "fetched_rows": int(stats.decode_fetched_rows.sum()), "cached_rows": int(stats.decode_cached_rows.sum()),
            "transfers": stats.transfers}


def run_offload_grid(config, loaded, text_ids: list[int], contexts: list[int], batches: list[int], steps: int,
                     rounds: int = 1, progress=print) -> list[dict]:
    """One row per (context, batch): each mode's measurement and the ratios between them, over `rounds` rounds of
    the three modes (each round in another order, so that a slow spell of this shared machine does not always fall
    on the same mode); with several, each round's figures too, and their medians."""
    base = dataclasses.replace(config, enable_prefix_caching=False, kv_offload="none")
    reference = LLMEngine(base, loaded=loaded)
    longest = reference.max_model_len - steps - 1  # a prompt, then steps + 1 generated tokens
    if rounds < 1:
        raise KvstrataError(f"rounds must be at least 1; got {rounds}")
    if max(contexts) > longest or min(contexts) < 2 or len(text_ids) < max(contexts):
        raise KvstrataError(f"contexts must be 2 to {min(longest, len(text_ids))} tokens (max_model_len "
                            f"{reference.max_model_len} less {steps + 1} generated tokens, and the text's length); "
                            f"got {contexts}")
    per_token = 2 * reference.kv_cache.num_layers * int(torch.tensor(reference.kv_cache.kv_shape).prod()) * 4
    rows = []
    for context in contexts:
        prompt = text_ids[:context]
        k, v = compute_kv(reference, prompt[:-1])
        kv = PreloadedKV(0, k, v)
        for batch in batches:
            memory = max(config.kv_cache_memory, int(1.2 * batch * (context + steps + 32) * per_token))
            measured = []
            for turn in range(rounds):
                runs = {}
                for mode in MODES[turn % len(MODES):] + MODES[:turn % len(MODES)]:  # each round starts elsewhere
                    mode_config = dataclasses.replace(base, kv_offload=mode, kv_cache_memory=memory)
                    runs[mode] = measure_mode(mode_config, loaded, kv, prompt, batch, steps)
                    progress(f"context {context} batch {batch} round {turn + 1} {mode}: {runs[mode]}")
                measured.append({mode: runs[mode] for mode in MODES} | ratios(runs))
            rows.append({"context": context, "batch": batch, **median_round(measured),
                         **({"rounds": measured} if rounds > 1 else {})})
    return rows


def ratios(runs: dict) -> dict:
    """InfiniGen's speed against `full` and `none`, measured and modeled, from one round's runs of the modes."""
    out = {"infinigen_vs_full": sig(runs["infinigen"]["tokens_per_s"] / runs["full"]["tokens_per_s"]),
           "infinigen_vs_none": sig(runs["infinigen"]["tokens_per_s"] / runs["none"]["tokens_per_s"])}
    for name in MODELED_LINKS:
        key = f"modeled_{name}_step_s"
        if key not in runs["full"]:  # measured on a GPU: nothing modeled
            continue
        out[f"modeled_{name}_infinigen_vs_full"] = sig(runs["full"][key] / runs["infinigen"][key])
    return out


def median_round(measured: list[dict]) -> dict:
    """Over rounds: each mode's run with the median step, and each ratio's median (every ratio is of one round)."""
    out = {mode: sorted((m[mode] for m in measured), key=lambda run: run["step_s"])[len(measured) // 2]
           for mode in MODES}
    return out | {key: sig(statistics.median(m[key] for m in measured)) for key in measured[0] if key not in MODES}


def crossover(rows: list[dict]) -> dict[int, int | None]:
    """Per batch, the shortest context from which infinigen decodes faster than none (measured)."""
    out = {}
    for batch in sorted({row["batch"] for row in rows}):
        faster = [row["context"] for row in rows if row["batch"] == batch and row["infinigen_vs_none"] > 1]
        out[batch] = min(faster) if faster else None
    return out


def run_offload(args) -> None:
    import sys

    from kvstrata.bench.report import emit, engine_info, machine_info
    from kvstrata.bench.workload import read_text
    from kvstrata.cli.engine_args import engine_config_from_args

    config = engine_config_from_args(args, varied=("kv_offload",))
    reference = LLMEngine(dataclasses.replace(config, kv_offload="none"))
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    text_ids = reference.tokenize(read_text(args.text))[args.skip_tokens :]
    rows = run_offload_grid(config, reference.loaded, text_ids, contexts, batches, args.steps, args.rounds,
                            progress=lambda line: print(line, file=sys.stderr))
    emit({"benchmark": "offload", "machine": machine_info(), **engine_info(reference),
          "workload": {"text": args.text.name, "skip_tokens": args.skip_tokens, "contexts": contexts,
                       "batches": batches, "decode_steps": args.steps, "rounds": args.rounds},
          "modeled": ("modeled_* figures replace the measured copy time by a link model's (nominal x16 bandwidth, "
                      "10 us per transfer, no overlap)" if config.device == "cpu" else
                      "none: on a GPU every copy crosses the real link and is measured"),
          "rows": rows, "infinigen_faster_than_none_from_context": crossover(rows)}, args.json)
