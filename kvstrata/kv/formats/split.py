"""K and V in two record formats (`--kv-format KEYS/VALUES`, e.g. int8/int4; llama.cpp's --cache-type-k and
--cache-type-v): each side's records are its format's, of its own size, written and read by the same compiled kernels
as a single format's (records.py). Keys are the side a few bits hurt most: a few of their channels are far larger
than the rest (KIVI's observation) and set the range that a token's or a group's codes span. On the default model
int8 keys with int4 values lose under a tenth of what int4 for both does, and int4 keys with int8 values nearly all
of it (docs/BENCHMARKS.md, "K and V in different formats")."""

from __future__ import annotations

from kvstrata.kv.formats.records import RecordFormat


class SplitFormat(RecordFormat):
    def __init__(self, keys: RecordFormat, values: RecordFormat):
        if keys.width != values.width:
            raise ValueError(f"K's format is {keys.width} values wide, V's {values.width}")
        super().__init__(keys.width)
        self.keys, self.values = keys, values
        self.name = f"{keys.name}/{values.name}"
        self.encodes_decoded_exactly = keys.encodes_decoded_exactly and values.encodes_decoded_exactly

    def side(self, kind):
        return self.keys if kind == "k" else self.values

    @property
    def record_bytes(self) -> int:
        raise TypeError(f"{self.name}'s K and V records differ in size: record_bytes_of('k') or ('v')")

    def record_bytes_of(self, kind):
        return self.side(kind).record_bytes

    def encode(self, x, layer, kind, positions):
        return self.side(kind).encode(x, layer, kind, positions)

    def decode(self, dense, sparse, layer, kind, positions):
        return self.side(kind).decode(dense, sparse, layer, kind, positions)

    def store_side_on_gpu(self, kind, x, slots, records):
        return self.side(kind).store_side_on_gpu(kind, x, slots, records)

    def gather_on_gpu(self, layer, kind, records, sparse, slots, positions, dtype):
        return self.side(kind).gather_on_gpu(layer, kind, records, sparse, slots, positions, dtype)
