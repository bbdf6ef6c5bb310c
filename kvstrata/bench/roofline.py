"""`kvstrata bench roofline`: the engine against this machine's limits on the default model.

Limits: a batch-1 decode step must stream every weight byte once, in the form --weights gives
them, so it takes at least decode_read_bytes / bandwidth; a token needs about 2 FLOPs per weight it multiplies (plus attention),
so tokens/s is at most GEMM rate / FLOPs per token, at the fastest GEMM the engine's products may run on (fp32, and
bfloat16 where quantized blocks are widened for products of many rows, model/block_linear.py). The engine's measured decode step and prefill
rate are reported as fractions of those limits (`decode_fraction`, `prefill_fraction`).
"""

from __future__ import annotations

import statistics
import time

import torch

from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.model.config import ModelConfig
from kvstrata.model.linear_layers import linear_layers
from kvstrata.model.quantized_linear import QuantizedEmbedding


def _distinct_bytes(tensors) -> int:
    seen = {id(t): t for t in tensors if t is not None}
    return sum(t.numel() * t.element_size() for t in seen.values())


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the weights occupy, in the form --weights gave them (a tied embedding counts once)."""
    return _distinct_bytes([*model.parameters(), *model.buffers()])


def decode_read_bytes(model: torch.nn.Module) -> int:
    """Weight bytes a batch-1 decode step reads: all of them, except that a quantized embedding is read one row
    per token (its codes count where the LM head shares them, as a tied model's block head does)."""
    embedding = {id(t) for m in model.modules() if isinstance(m, QuantizedEmbedding) for t in m.buffers()}
    elsewhere = {id(t) for m in model.modules() if not isinstance(m, QuantizedEmbedding)
                 for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]}
    return _distinct_bytes([t for t in [*model.parameters(), *model.buffers()]
                            if id(t) not in embedding or id(t) in elsewhere])


def flops_per_token(model: torch.nn.Module, config: ModelConfig, context_len: int, with_logits: bool) -> float:
    """2 FLOPs per multiplied weight plus attention's two products over `context_len` keys in every
    layer. The embedding lookup multiplies nothing; the LM head counts only `with_logits` (a prompt
    token mid-prefill needs no logits, and the engine computes none)."""
    linears = [m for m in linear_layers(model) if with_logits or m is not model.lm_head]
    matmul_weights = sum(m.in_features * m.out_features for m in linears)
    attention = 2 * 2 * context_len * config.num_heads * config.head_dim * config.num_layers
    return 2 * matmul_weights + attention


def workload_flops(model: torch.nn.Module, config: ModelConfig, requests: int, prompt_len: int, output_len: int) -> float:
    """FLOPs of `requests` requests of `prompt_len` + `output_len` tokens: every token through the
    layers (at the mean context), logits only for each sampled token."""
    tokens = prompt_len + output_len
    per_token = flops_per_token(model, config, tokens // 2, with_logits=False)
    head = model.lm_head.in_features * model.lm_head.out_features
    return requests * (tokens * per_token + 2 * head * output_len)


def measure_decode_step(engine: LLMEngine, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """(median seconds of a batch-1 decode step after `prompt`, the greedy tokens of the request)."""
    seconds, tokens = decode_step_seconds(engine, prompt, steps)
    return statistics.median(seconds), tokens


def decode_step_seconds(engine: LLMEngine, prompt: list[int], steps: int) -> tuple[list[float], list[int]]:
    """(seconds of each batch-1 decode step after `prompt`, the greedy tokens of the request)."""
    engine.step_stats.clear()
    request = engine.add_request(prompt, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = list(output.token_ids)
    engine.abort(request)
    return [s.seconds for s in engine.step_stats if s.prefill_tokens == 0], tokens


def measure_prefill_rate(engine: LLMEngine, prompts: list[list[int]]) -> float:
    """Prompt tokens per second of a single prefill, best over distinct `prompts` (no prefix-cache hits)."""
    best = 0.0
    for prompt in prompts:
        start = time.perf_counter()
        engine.add_request(prompt, SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        best = max(best, len(prompt) / (time.perf_counter() - start))
    return best


def measure_concurrent_rate(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> float:
    """Total (prompt + output) tokens per second of all `prompts` run together."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return sum(len(p) + output_len for p in prompts) / (time.perf_counter() - start)
