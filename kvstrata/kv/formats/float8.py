"""fp8 and fp8_e5m2: each value a float8 number (e4m3fn: 4 exponent and 3 mantissa bits, largest 448; e5m2: 5 and
2, largest 57,344) times its token's float16 scale (kv/formats/scaled_bytes.py). vLLM's `--kv-cache-dtype fp8`
stores the same float8 codes with one scale per layer; here the scale is per token (2 bytes of a record's 194 on the
default model), which needs no calibration and follows each token's range. Unlike int8's evenly spaced codes, a
float8 code keeps its relative precision (at worst 1/16 of the value for e4m3fn, 1/8 for e5m2, down to the
subnormals) for a token's small values beside its largest; on the default model that loses to int8's finer steps
near a token's largest values (docs/BENCHMARKS.md, "fp8").
"""

from __future__ import annotations

import torch

from kvstrata.kv.formats.scaled_bytes import ScaledByteFormat

FLOAT8_TYPES = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class Float8Format(ScaledByteFormat):
    def __init__(self, width: int, name: str = "fp8"):
        super().__init__(width)
        self.name = name
        self.dtype = FLOAT8_TYPES[name]
        self.code_max = torch.finfo(self.dtype).max

    def codes(self, scaled):
        return scaled.to(self.dtype).view(torch.uint8)

    def values(self, codes):
        return codes.view(self.dtype).float()
