"""KV given ready-made for a range of a prompt's tokens (a decoded saved context)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PreloadedKV:
    start: int  # position of the first token
    k: torch.Tensor  # [layers, tokens, kv_heads, head_dim]
    v: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + self.k.shape[1]

    def clipped(self, end: int) -> PreloadedKV | None:
        """The part before token `end`, if any."""
        if end <= self.start:
            return None
        return PreloadedKV(self.start, self.k[:, : end - self.start], self.v[:, : end - self.start])
