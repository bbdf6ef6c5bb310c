"""Plain integer formats: int8 (symmetric, per-token absmax) and int4 (asymmetric, groups of 64 values
by default).

int8 record: W codes (int8) + one float16 scale. int4 record: W / 2 bytes of nibbles + per group a
float16 minimum and step (32 bits per group: 0.5 bits per value with groups of 64, 1 with 32, 2 with
16). Error bound: half a step.
"""

from __future__ import annotations

import torch

from kvstrata.kv.formats.asymmetric import dequantize_asymmetric, quantize_asymmetric
from kvstrata.kv.formats.base import EncodedTokens
from kvstrata.kv.formats.float16_params import params_from_bytes, params_to_bytes
from kvstrata.kv.formats.nibbles import pack_nibbles, unpack_nibbles
from kvstrata.kv.formats.records import RecordFormat
from kvstrata.kv.formats.scaled_bytes import ScaledByteFormat

INT4_GROUP = 64


class Int8Format(ScaledByteFormat):
    name = "int8"
    code_max = 127

    def codes(self, scaled):
        return torch.round(scaled).clamp(-127, 127).to(torch.int8).view(torch.uint8)

    def values(self, codes):
        return codes.view(torch.int8).float()

    def store_side_on_gpu(self, kind, x, slots, records):
        from kvstrata.kv.gpu import integer_rows  # imports Triton: only where the GPU kernels run

        integer_rows.int8_encode(x, slots, records)
        return True

    def gather_on_gpu(self, layer, kind, records, sparse, slots, positions, dtype):
        from kvstrata.kv.gpu import integer_rows

        return integer_rows.int8_decode(records, slots, positions, self.width, dtype)


class Int4Format(RecordFormat):
    name = "int4"

    def __init__(self, width: int, group: int = INT4_GROUP):
        super().__init__(width)
        self.group_size = group
        self.groups = -(-width // group)
        self.padded = self.groups * group
        self.code_bytes = -(-width // 2)  # only the real values' codes are stored, not the last group's padding

    @property
    def record_bytes(self) -> int:
        return self.code_bytes + 4 * self.groups

    def encode(self, x, layer, kind, positions) -> EncodedTokens:
        # a short last group is padded with copies of its last value, which widen neither its range nor its step
        padding = x[:, -1:].expand(-1, self.padded - self.width)
        grouped = torch.cat((x, padding), dim=1).view(x.shape[0], self.groups, self.group_size)
        codes, params = quantize_asymmetric(grouped, 2, 4)
        codes = codes.view(x.shape[0], -1)[:, : 2 * self.code_bytes]
        return EncodedTokens(torch.cat((pack_nibbles(codes), params_to_bytes(params.view(x.shape[0], -1))), dim=1))

    def decode(self, dense, sparse, layer, kind, positions) -> torch.Tensor:
        codes = unpack_nibbles(dense[:, : self.code_bytes])
        codes = torch.nn.functional.pad(codes, (0, self.padded - codes.shape[1])).view(-1, self.groups, self.group_size)
        params = params_from_bytes(dense[:, self.code_bytes :]).view(-1, self.groups, 2)
        return dequantize_asymmetric(codes, params, 2).view(dense.shape[0], -1)[:, : self.width]

    def store_side_on_gpu(self, kind, x, slots, records):
        from kvstrata.kv.gpu import integer_rows  # imports Triton: only where the GPU kernels run

        if self.group_size & (self.group_size - 1):  # the kernel takes a group's values in pairs, a power of two
            return False
        integer_rows.int4_encode(x, slots, records, self.group_size, self.code_bytes)
        return True

    def gather_on_gpu(self, layer, kind, records, sparse, slots, positions, dtype):
        from kvstrata.kv.gpu import integer_rows

        return integer_rows.int4_decode(records, slots, positions, self.width, self.group_size, self.code_bytes, dtype)
