"""`kvstrata bench throughput`: an offline workload through each scheduler and through transformers.

All requests arrive at once (time 0). kvstrata runs them with each scheduler; Hugging Face
transformers runs them with `generate` in left-padded static batches on the same weights.
Rates are per wall-clock second of the whole run: prefill = prompt tokens, decode = output tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from kvstrata.bench.memory import peak_rss
from kvstrata.bench.stats import summarize
from kvstrata.bench.transformers_model import transformers_model
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.model.loader import LoadedModel

Requests = list[tuple[list[int], int]]


def _figures(requests: Requests, wall: float, ttft: list[float], tpot: list[float], e2e: list[float],
             peak: int) -> dict:
    prompt_tokens = sum(len(p) for p, _ in requests)
    output_tokens = sum(n for _, n in requests)
    return {
        "wall_s": round(wall, 3),
        "prefill_tokens_per_s": round(prompt_tokens / wall, 2),
        "decode_tokens_per_s": round(output_tokens / wall, 2),
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / wall, 2),
        **summarize(ttft, "ttft_ms", 1000),
        **summarize(tpot, "tpot_ms", 1000),
        **summarize(e2e, "e2e_ms", 1000),
        "peak_rss_mib": round(peak / 2**20, 1),
    }


def run_kvstrata(config: EngineConfig, loaded: LoadedModel, requests: Requests,
                 prepare: Callable[[LLMEngine], None] | None = None) -> dict:
    """`prepare`: told the engine before anything runs on it (a benchmark's baseline changes it there)."""
    engine = LLMEngine(config, loaded=loaded)
    if prepare is not None:
        prepare(engine)
    # Warm up on a reversed snippet: no prompt of the run shares its prefix-cache blocks.
    engine.add_request(requests[0][0][15::-1], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.step_stats.clear()  # the run's steps only
    outputs = []
    with peak_rss() as peak, tqdm(total=len(requests), desc=f"kvstrata {config.scheduler}", leave=False) as bar:
        start = time.perf_counter()
        for prompt, output_len in requests:
            engine.add_request(prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    outputs.append(output)
                    bar.update(1)
        wall = time.perf_counter() - start
    metrics = [o.metrics for o in outputs]
    figures = _figures(
        requests, wall, [m.ttft for m in metrics], [m.tpot for m in metrics if m.tpot is not None],
        [m.e2e for m in metrics], peak[0],
    )
    # KV memory beyond --kv-cache-memory: pools that grew because the data needed more (Oaken's sparse pages,
    # KIVI's window), so that a comparison at one budget shows who went past it; and how many sequences the
    # budget let run at once, and how often the scheduler took one out to make room (its work is done again)
    steps = engine.step_stats
    return {**figures, "kv_grown_bytes": engine.kv_cache.grown_bytes(),
            "most_sequences_in_a_step": max((s.num_seqs for s in steps), default=0),
            "preemptions": sum(s.num_preempted for s in steps)}


def run_transformers(loaded: LoadedModel, requests: Requests, batch_size: int) -> dict:
    """`generate` on the same weights, greedy, in left-padded batches of `batch_size` (in arrival order)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    model = transformers_model(loaded.source)
    pad = loaded.config.eos_token_id if isinstance(loaded.config.eos_token_id, int) else 0

    class StepClock(LogitsProcessor):
        """Called once per generation step: records when each step's logits were ready."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    ttft, tpot, e2e = [], [], []
    with peak_rss() as peak, torch.inference_mode(), tqdm(total=len(requests), desc="transformers", leave=False) as bar:
        start = time.perf_counter()
        for first in range(0, len(requests), batch_size):
            batch = requests[first : first + batch_size]
            width = max(len(p) for p, _ in batch)
            new_tokens = max(n for _, n in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
            clock = StepClock()
            model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=pad, logits_processor=LogitsProcessorList([clock]))
            end = time.perf_counter()
            for _, n in batch:
                ttft.append(clock.times[0] - start)
                e2e.append(end - start)
                if n > 1:
                    tpot.append((end - clock.times[0]) / (new_tokens - 1))
            bar.update(len(batch))
        wall = time.perf_counter() - start
    return _figures(requests, wall, ttft, tpot, e2e, peak[0])
