"""Drafts for speculative decoding by prompt lookup: the tokens that followed the latest earlier occurrence of a
sequence's last n tokens in its own prompt and output (vLLM's "ngram" method, transformers' `prompt_lookup_num_tokens`).

Output that copies its context (a document edited, code reworked, a quoted passage, a repeated pattern) is drafted
well; elsewhere no n-gram matches and the sequence decodes as usual. Each sequence's tokens are kept in a growing
numpy array, so a step's lookup compares arrays instead of converting the whole token list again.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int, max_n: int):
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: dict[int, tuple[np.ndarray, int]] = {}  # seq_id -> (buffer, tokens in it)

    def propose(self, seq_id: int, token_ids: list[int], limit: int) -> list[int]:
        """Up to min(num_tokens, limit) drafts to follow `token_ids`: the longest suffix of min_n .. max_n tokens
        seen before, its latest earlier occurrence, and what came after it; [] where none matches."""
        count = min(self.num_tokens, limit)
        if count <= 0:
            return []
        tokens = self._array(seq_id, token_ids)
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            # occurrences starting at i < end - n, so that a token follows each
            matches = tokens[: end - n] == tokens[end - n]
            for offset in range(1, n):
                matches &= tokens[offset : end - n + offset] == tokens[end - n + offset]
            found = np.flatnonzero(matches)
            if len(found):
                start = int(found[-1]) + n
                return tokens[start : start + count].tolist()
        return []

    def forget(self, seq_id: int) -> None:
        self._tokens.pop(seq_id, None)

    def _array(self, seq_id: int, token_ids: list[int]) -> np.ndarray:
        """`token_ids` as an array, extended from what the sequence's last lookup saw (its tokens only grow)."""
        buffer, filled = self._tokens.get(seq_id, (np.empty(0, dtype=np.int64), 0))
        if len(token_ids) > len(buffer):
            grown = np.empty(max(2 * len(buffer), len(token_ids), 256), dtype=np.int64)
            grown[:filled] = buffer[:filled]
            buffer = grown
        buffer[filled : len(token_ids)] = token_ids[filled:]
        self._tokens[seq_id] = (buffer, len(token_ids))
        return buffer[: len(token_ids)]
