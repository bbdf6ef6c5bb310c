"""Turn next-token logits into tokens: greedy, temperature, top-k, top-p, seeds, logprobs."""

from __future__ import annotations

import torch

from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.engine.sequence import TokenLogprobs


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order Hugging Face applies them) on one row."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the ones before it already cover top_p; the first always stays.
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= params.top_p
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row of `logits` [rows, vocab] (fp32), plus logprobs where asked for."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            probs = filtered_logits(logits[row], p).softmax(-1)
            tokens[row] = int(torch.multinomial(probs, 1, generator=gen).item())
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    wanted = [row for row, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        # Logprobs of the model's own distribution, before temperature and filtering.
        log_dist = logits[wanted].log_softmax(-1)
        for i, row in enumerate(wanted):
            top = torch.topk(log_dist[i], params[row].logprobs) if params[row].logprobs else None
            logprobs[row] = TokenLogprobs(
                token_id=tokens[row],
                logprob=float(log_dist[i, tokens[row]]),
                top={} if top is None else dict(zip(top.indices.tolist(), top.values.tolist())),
            )
    return tokens, logprobs
