"""Formats of one byte per value and a float16 scale per token (int8, fp8, fp8_e5m2): the scale is the token's
absmax over the largest code (`code_max`), rounded up to a float16, so no value lands beyond the codes; a value is
stored as the code of value / scale. Record: W codes, then the scale (W + 2 bytes). Subclasses say what a byte
means; the compiled store and readers (kv/kernels/record_store.cpp, record_rows.cpp) take the format's name.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from kvstrata.kv.formats.base import EncodedTokens, KVFormat
from kvstrata.kv.formats.float16_params import float16_up, params_from_bytes, params_to_bytes


class ScaledByteFormat(KVFormat):
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

    def store_in_place(self, kernel, layer, slots, positions, k, v, records, sparse):
        """The compiled store: `encode`'s bytes, written at the slots."""
        kernel.record_store(k, v, slots, records["k"], records["v"], self.name, 0)
        return True

    def attend_in_place(self, kernel, layer, q, records, sparse, block_tables, context_lens, block_size,
                        min_shared_tokens=0):
        return kernel.paged_decode_attention_scaled_bytes(q, records["k"], records["v"], block_tables, context_lens,
                                                          block_size, self.width // q.shape[-1], self.name,
                                                          q.shape[-1] ** -0.5, min_shared_tokens)

    def read_in_place(self, kernel, layer, records, sparse, block_tables, context_lens, block_size):
        # records are read whole: one "head" of all the token's values
        return kernel.paged_read_scaled_bytes(records["k"], records["v"], block_tables, context_lens, block_size, 1,
                                              self.width, self.name)
