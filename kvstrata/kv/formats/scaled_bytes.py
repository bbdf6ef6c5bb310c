"""Formats of one byte per value and a float16 scale per token (int8, fp8, fp8_e5m2): the scale is the token's
absmax over the largest code (`code_max`), rounded up to a float16, so no value lands beyond the codes; a value is
stored as the code of value / scale. Record: W codes, then the scale (W + 2 bytes). Subclasses say what a byte
means; the compiled store and readers are the record formats' (records.py).
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from kvstrata.kv.formats.base import EncodedTokens
from kvstrata.kv.formats.float16_params import float16_up, params_from_bytes, params_to_bytes
from kvstrata.kv.formats.records import RecordFormat


class ScaledByteFormat(RecordFormat):
    code_max: float

    @property
    def record_bytes(self) -> int:
        return self.width + 2

    @abstractmethod
    def codes(self, scaled: torch.Tensor) -> torch.Tensor:
        """uint8 codes of values already divided by their token's scale."""

    @abstractmethod
    def values(self, codes: torch.Tensor) -> torch.Tensor:
        """float32 values (before the scale) of uint8 codes."""

    def encode(self, x, layer, kind, positions) -> EncodedTokens:
        scale = float16_up(x.abs().amax(dim=1, keepdim=True) / self.code_max)  # NaN for a token float16 cannot scale
        safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
        return EncodedTokens(torch.cat((self.codes(x / safe), params_to_bytes(scale)), dim=1))

    def decode(self, dense, sparse, layer, kind, positions) -> torch.Tensor:
        return self.values(dense[:, : self.width].contiguous()) * params_from_bytes(dense[:, self.width :])
