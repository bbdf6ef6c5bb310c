"""Verifying a sequence's drafts (speculative decoding) in the step that computes them.

A sequence with drafts d1 .. dk has k + 1 logit rows in the step: after its last token, and after each draft. Each
row is sampled as a plain decode would sample it, with the drafts before it as its history (penalties, min_tokens
and bad words read it), and the drafts are accepted while each equals the token sampled before it. What is appended
is the accepted drafts and the token sampled after them, each drawn from its row's distribution p: a draft d is
accepted with probability p(d), and otherwise the token drawn is one of the others, with probability p(t) each (the
rejection sampling of speculative decoding where the draft's own distribution is certain of d, as prompt lookup's
is). Greedy decoding gives the tokens it gives without drafts: a sequence's rows compute what its lone decode
computes (the paged attention kernel attends rows sharing a block table as their sequence alone; the weights' kernels
multiply rows apart, on a CPU with AVX-512 VNNI).
"""

from __future__ import annotations

from collections.abc import Iterator

from kvstrata.engine.sequence import Sequence


def verifies(seq: Sequence, num_tokens: int) -> bool:
    """Whether a step of `num_tokens` tokens of `seq` runs its last token and drafts after it."""
    return num_tokens > 1 and seq.num_pending_tokens == 1


def sequence_rows(rows: list[Sequence]) -> Iterator[tuple[Sequence, int, int]]:
    """Each sequence of `rows` (one per logit row, a sequence's rows side by side) with its first row and the row
    after its last."""
    first = 0
    for row in range(1, len(rows) + 1):
        if row == len(rows) or rows[row] is not rows[first]:
            yield rows[first], first, row
            first = row


def draft_histories(rows: list[Sequence]) -> list[list[int]]:
    """Each row's history: its sequence's tokens and the drafts before the row (the tokens alone where its sampling
    reads no history)."""
    histories = []
    for seq, first, end in sequence_rows(rows):
        histories += [seq.token_ids + seq.draft_token_ids[:j] if j and seq.params.reads_history else seq.token_ids
                      for j in range(end - first)]
    return histories


def rejected_draft_positions(seq: Sequence, num_accepted_tokens: int) -> range:
    """Positions of `seq`'s drafts that its step rejected (their KV was written), given the tokens it gains
    (`accepted_tokens`) and before they are appended."""
    return range(seq.num_tokens + num_accepted_tokens - 1, seq.num_tokens + len(seq.draft_token_ids))


def accepted_tokens(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a sequence gains: the drafts that equal the token sampled before them, and the token sampled
    after the last of those (`sampled` holds one token per row: len(drafts) + 1)."""
    accepted = 0
    while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
        accepted += 1
    return sampled[: accepted + 1]
