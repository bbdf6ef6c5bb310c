"""Turn next-token logits into tokens: logit bias, allowed tokens and structured output's constraint (masks from
grammar_matcher.py), penalties, min_tokens and bad words (penalties.py), greedy, temperature, top-k, top-p, min-p,
seeds, logprobs.

Every row is filtered and drawn in batched tensor operations, and the tokens reach Python in one
transfer at the end: no host sync per row (rows with their own seed draw from their own generator).

No accepted parameter can make a row's distribution NaN: temperatures below `GREEDY_BELOW_TEMPERATURE`
sample greedily (their limit; dividing fp32 logits by them would overflow), top-p and min-p always keep the
most likely token (a top_p that rounds to 0 in fp32 would otherwise drop every token), the penalties' ranges
keep logits finite, a request whose min_tokens or bad words could ban every token it may generate is refused when
it is added (`LLMEngine.check_sampling`), and a constraint always allows some token (with neither min_tokens,
allowed_token_ids nor bad words beside it: SamplingParams refuses those).
"""

from __future__ import annotations

import numpy as np
import torch

from kvstrata.engine.penalties import Histories, penalized_logits
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.engine.sequence import TokenLogprobs


def biased_logits(logits: torch.Tensor, params: list[SamplingParams],
                  constraints: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """Each row's `logit_bias` added to its logits [rows, vocab], and its tokens outside `allowed_token_ids` or
    outside its constraint (a bool mask [vocab] of the tokens its structured output allows next) set to -inf (a
    copy, where a row has any)."""
    constraints = constraints or [None] * len(params)
    rows = [row for row, p in enumerate(params)
            if p.logit_bias or p.allowed_token_ids is not None or constraints[row] is not None]
    if not rows:
        return logits
    logits = logits.clone()
    vocab, device = logits.shape[-1], logits.device
    for row in rows:
        bias, allowed = params[row].logit_bias, params[row].allowed_token_ids
        if bias:
            tokens = torch.tensor(list(bias), dtype=torch.long, device=device)
            logits[row, tokens] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=device)
        if allowed is not None:
            banned = torch.ones(vocab, dtype=torch.bool, device=device)
            banned[torch.tensor(allowed, device=device)] = False
            logits[row] = logits[row].masked_fill(banned, float("-inf"))
        if constraints[row] is not None:
            logits[row] = logits[row].masked_fill(~constraints[row], float("-inf"))
    return logits


def filtered_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p (the order Hugging Face applies them), row by row of [rows,
    vocab]."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    if bool((top_k < vocab).any()):
        largest = torch.topk(logits, int(top_k.max())).values  # [rows, largest k], descending
        logits = logits.masked_fill(logits < largest.gather(1, top_k[:, None] - 1), float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device)
    if bool((top_p < 1.0).any()):
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the ones before it already cover top_p; the first always stays.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p[:, None]
        drop_sorted[:, 0] = False
        logits = logits.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=device)
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)  # the likeliest token always stays: min_p <= 1
        logits = logits.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))
    return logits


def _numpy_rows(logits: torch.Tensor) -> np.ndarray | None:
    """`logits` as a numpy array where they are float32 on the CPU, else None: there numpy's argmax and
    isfinite(...).all() over a vocabulary row took a fraction of torch's time (a probe on the development machine),
    and at batch 1 such calls are a visible part of a decode step."""
    return logits.numpy() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None


def finite_rows(logits: torch.Tensor) -> list[bool]:
    """Whether each row of `logits` [rows, vocab] holds only finite values."""
    rows = _numpy_rows(logits)
    if rows is not None:
        return np.isfinite(rows).all(axis=-1).tolist()
    return torch.isfinite(logits).all(dim=-1).tolist()


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit (the first of equal ones)."""
    rows = _numpy_rows(logits)
    if rows is not None:
        return torch.from_numpy(rows.argmax(axis=-1))
    return logits.argmax(dim=-1)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    histories: Histories, constraints: list[torch.Tensor | None] | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row of `logits` [rows, vocab] (fp32, finite), plus logprobs where asked for. `histories`:
    the rows' sequences, which penalties, min_tokens and bad words read; `constraints`: the tokens each row's structured
    output allows next (grammar_matcher.allowed_tokens; None: unconstrained)."""
    biased = penalized_logits(biased_logits(logits, params, constraints), params, histories)
    tokens = greedy_tokens(biased)
    drawn = [row for row, p in enumerate(params) if not p.greedy]
    if drawn:
        probs = filtered_logits(biased[drawn], [params[row] for row in drawn]).softmax(-1)
        unseeded = [i for i, row in enumerate(drawn) if generators[row] is None]
        choice = torch.empty(len(drawn), dtype=torch.long, device=logits.device)
        if unseeded:
            choice[unseeded] = torch.multinomial(probs[unseeded], 1)[:, 0]
        for i, row in enumerate(drawn):
            if generators[row] is not None:
                choice[i] = torch.multinomial(probs[i], 1, generator=generators[row])[0]
        tokens[drawn] = choice
    token_list = tokens.tolist()
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    wanted = [row for row, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        # Logprobs of the model's own distribution, before logit_bias, constraints, penalties, temperature and
        # filtering.
        log_dist = logits[wanted].log_softmax(-1)
        for i, row in enumerate(wanted):
            logprobs[row] = token_logprobs(log_dist[i : i + 1], [token_list[row]], params[row].logprobs)[0]
    return token_list, logprobs


def token_logprobs(log_dist: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprobs]:
    """Each row's token's logprob in `log_dist` [rows, vocab] (log-softmaxed) and its rank there (1: the likeliest;
    vLLM's: one plus the tokens strictly likelier), and the row's `top` likeliest."""
    chosen = log_dist.gather(1, torch.tensor(tokens, device=log_dist.device)[:, None])
    ranks = ((log_dist > chosen).sum(-1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    if not top:
        return [TokenLogprobs(token, logprob, {}, rank) for token, logprob, rank in zip(tokens, chosen, ranks)]
    best = torch.topk(log_dist, top)
    return [TokenLogprobs(token, logprob, dict(zip(indices, values)), rank)
            for token, logprob, rank, indices, values in zip(tokens, chosen, ranks, best.indices.tolist(),
                                                             best.values.tolist())]
