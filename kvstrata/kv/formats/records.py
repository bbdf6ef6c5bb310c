"""Formats of one fixed-size record per token and side, which the compiled record kernels write and read by the
format's name (kv/kernels/record_store.cpp, record_rows.cpp, record_form.h): int8, fp8, fp8_e5m2 (scaled_bytes.py)
and int4 (integer.py). A cache's K and V are each in a side's format: the same one, or two (split.py)."""

from __future__ import annotations

from kvstrata.kv.formats.base import KVFormat


class RecordFormat(KVFormat):
    group_size = 0  # values per float16 (minimum, step) pair where the format has groups (int4); 0 where not

    def side(self, kind: str) -> RecordFormat:
        """The format of K ("k") or V ("v") records: this one, unless split."""
        return self

    def _kernel_forms(self) -> tuple[str, int, str, int]:
        keys, values = self.side("k"), self.side("v")
        return keys.name, keys.group_size, values.name, values.group_size

    def store_in_place(self, kernel, layer, slots, positions, k, v, records, sparse):
        """The compiled store: `encode`'s bytes of each side, written at the slots."""
        kernel.record_store(k, v, slots, records["k"], records["v"], *self._kernel_forms())
        return True

    def attend_in_place(self, kernel, layer, q, records, sparse, block_tables, context_lens, block_size,
                        min_shared_tokens=0, window=0):
        return kernel.paged_decode_attention_records(q, records["k"], records["v"], block_tables, context_lens,
                                                     block_size, self.width // q.shape[-1], *self._kernel_forms(),
                                                     q.shape[-1] ** -0.5, min_shared_tokens, window)

    def read_in_place(self, kernel, layer, records, sparse, block_tables, context_lens, block_size):
        # records are read whole: one "head" of all the token's values
        return kernel.paged_read_records(records["k"], records["v"], block_tables, context_lens, block_size, 1,
                                         self.width, *self._kernel_forms())
