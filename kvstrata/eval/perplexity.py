"""`kvstrata eval ppl`: perplexity of a long text, scored through the KV cache in decode mode."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.errors import KvstrataError
from kvstrata.eval.cache_scorer import CacheScorer

SEGMENT = 256  # tokens per reported segment, as in the InfiniGen notes


def window_starts(num_tokens: int, window: int, count: int) -> list[int]:
    """`count` window offsets spread evenly over the text."""
    if num_tokens < window:
        raise KvstrataError(f"the text has {num_tokens} tokens, fewer than one window of {window}")
    if count == 1:
        return [0]
    return [round(i * (num_tokens - window) / (count - 1)) for i in range(count)]


def evaluate_perplexity(
    engine: LLMEngine, token_ids: list[int], context_len: int, score_len: int, windows: int, tokens_per_step: int = 1
) -> dict:
    """Perplexity of the `score_len` tokens after each `context_len`-token context, per window and per segment."""
    scorer = CacheScorer(engine)
    window = context_len + score_len
    nll_rows = []
    per_window = []
    for start in window_starts(len(token_ids), window, windows):
        piece = token_ids[start : start + window]
        logits = scorer.next_token_logits(piece, context_len, tokens_per_step)
        nll = F.cross_entropy(logits, torch.tensor(piece[context_len:], device=logits.device), reduction="none")
        nll_rows.append(nll.cpu())
        per_window.append({"start_token": start, "perplexity": round(math.exp(nll.mean().item()), 4)})
    nll = torch.stack(nll_rows)  # [windows, score_len]
    segments = [
        {
            "from": context_len + lo,
            "to": context_len + min(lo + SEGMENT, score_len),
            "perplexity": round(math.exp(nll[:, lo : lo + SEGMENT].mean().item()), 4),
        }
        for lo in range(0, score_len, SEGMENT)
    ]
    return {
        "perplexity": round(math.exp(nll.mean().item()), 4),
        "mean_nll": round(nll.mean().item(), 6),
        "scored_tokens": nll.numel(),
        "windows": per_window,
        "segments": segments,
    }
