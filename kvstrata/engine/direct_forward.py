"""Running one sequence through the model outside the scheduler: evaluations and KV export."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.engine.sequence import Sequence
from kvstrata.errors import KvstrataError

if TYPE_CHECKING:
    from kvstrata.engine.llm_engine import LLMEngine


def forward_tokens(engine: LLMEngine, seq: Sequence, num_tokens: int, logits: bool = True) -> torch.Tensor | None:
    """Run `num_tokens` more of `seq` through the model; logits [num_tokens, vocab] in fp32, if asked for."""
    if not engine.kv_manager.grow(seq, num_tokens):
        raise KvstrataError(
            f"the KV cache budget ({engine.config.kv_cache_memory} bytes) is too small for {seq.num_tokens} tokens"
        )
    _, hidden = engine.runner.forward([(seq, num_tokens)])
    seq.num_computed_tokens += num_tokens
    return engine.runner.model.compute_logits(hidden).float() if logits else None


@torch.inference_mode()
def compute_kv(engine: LLMEngine, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill `token_ids` (in chunks of the engine's chunk size) and return their K and V,
    [layers, tokens, kv_heads, head_dim] each, in float32 on the CPU (the paper's calculate_kv)."""
    if not token_ids or len(token_ids) > engine.max_model_len:
        raise KvstrataError(f"a context must have 1 to {engine.max_model_len} tokens, got {len(token_ids)}")
    seq = Sequence(seq_id=-1, request_id="compute_kv", prompt=None, prompt_token_ids=list(token_ids),
                   params=SamplingParams())
    try:
        while seq.num_computed_tokens < len(token_ids):
            num_tokens = min(engine.config.chunk_size, len(token_ids) - seq.num_computed_tokens)
            forward_tokens(engine, seq, num_tokens, logits=False)
        layers = [engine.kv_cache.read(layer, seq.block_table, len(token_ids))
                  for layer in range(engine.loaded.config.num_layers)]
    finally:
        engine.kv_manager.free(seq)
    return torch.stack([k for k, _ in layers]).float().cpu(), torch.stack([v for _, v in layers]).float().cpu()
