"""What the tokens a sequence already holds do to its next-token logits: repetition, frequency and presence
penalties (as vLLM and OpenAI define them), `min_tokens`, which bans the tokens that would end the output
until it is that long, and `bad_words`, which bans the token that would complete one. Applied after logit_bias,
before the greedy choice and temperature (vLLM's order).

Rows without any are left as they are; the penalized ones are penalized together, from token counts built in one
scatter per step, and the tokens bad words ban are set in one indexed write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.engine.bad_words import banned_next_tokens
from kvstrata.engine.sampling_params import SamplingParams


@dataclass
class Histories:
    """The rows' sequences: each row's tokens so far (its prompt first) and how many of them are the prompt, the
    model's end-of-sequence token ids, and each row's bad words as tokens (none: no row has any)."""

    token_ids: list[list[int]]
    num_prompt: list[int]
    eos_token_ids: set[int]
    bad_words: list[list[tuple[int, ...]]] | None = None

    def output(self, row: int) -> list[int]:
        return self.token_ids[row][self.num_prompt[row]:]

    def prompt(self, row: int) -> list[int]:
        return self.token_ids[row][: self.num_prompt[row]]


def penalized_logits(logits: torch.Tensor, params: list[SamplingParams], histories: Histories) -> torch.Tensor:
    """`logits` [rows, vocab] with each row's penalties, min_tokens ban and bad words applied (a copy, where a row
    has any)."""
    banning = [row for row, p in enumerate(params)
               if len(histories.token_ids[row]) - histories.num_prompt[row] < p.min_tokens]
    penalized = [row for row, p in enumerate(params) if p.penalizes]
    with_bad_words = [row for row, words in enumerate(histories.bad_words or []) if words]
    if not banning and not penalized and not with_bad_words:
        return logits
    logits = logits.clone()
    if penalized:
        logits[penalized] = _penalize(logits[penalized], [params[row] for row in penalized], histories, penalized)
    if banning:
        _ban_ends(logits, banning, params, histories.eos_token_ids)
    if with_bad_words:
        banned = [(row, token) for row in with_bad_words
                  for token in banned_next_tokens(histories.bad_words[row], histories.output(row))]
        if banned:
            logits[torch.tensor(banned, device=logits.device).T.unbind()] = float("-inf")
    return logits


def _penalize(logits: torch.Tensor, params: list[SamplingParams], histories: Histories,
              rows: list[int]) -> torch.Tensor:
    output_counts = _token_counts([histories.output(row) for row in rows], logits)
    seen = output_counts > 0
    if any(p.repetition_penalty != 1 for p in params):  # only it reads the prompt
        seen |= _token_counts([histories.prompt(row) for row in rows], logits) > 0

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], dtype=logits.dtype, device=logits.device)[:, None]

    repetition = per_row("repetition_penalty")
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - per_row("frequency_penalty") * output_counts - per_row("presence_penalty") * (output_counts > 0)


def _token_counts(sequences: list[list[int]], like: torch.Tensor) -> torch.Tensor:
    """How often each token id occurs in each sequence: [sequences, vocab], the dtype and device of `like`."""
    counts = torch.zeros(len(sequences), like.shape[-1], dtype=like.dtype, device=like.device)
    lengths = torch.tensor([len(s) for s in sequences])
    if int(lengths.sum()) == 0:
        return counts
    tokens = torch.cat([torch.tensor(s, dtype=torch.long) for s in sequences if s]).to(like.device)
    rows = torch.repeat_interleave(torch.arange(len(sequences)), lengths).to(like.device)
    return counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=like.dtype), accumulate=True)


def _ban_ends(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], eos_token_ids: set[int]) -> None:
    """No row of `rows` may end now: the tokens that would end it get -inf."""
    vocab = logits.shape[-1]
    for row in rows:
        ends = sorted(token for token in params[row].ending_tokens(eos_token_ids) if token < vocab)
        if ends:
            logits[row, torch.tensor(ends, device=logits.device)] = float("-inf")
