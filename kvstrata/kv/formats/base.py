"""How one token's K or V is stored in the paged cache: a fixed-size record, plus sparse bytes for
formats that keep outliers apart (Oaken). A format encodes each new token when it is written and
decodes on read for attention (DESIGN.md, kv/formats)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvstrata.kv.sparse_pages import SparsePages


@dataclass
class EncodedTokens:
    dense: torch.Tensor  # uint8 [N, record_bytes]
    sparse: torch.Tensor | None = None  # uint8 [S]: every token's variable-length bytes, token after token
    sparse_bytes: torch.Tensor | None = None  # int64 [N]: how many of `sparse` belong to each token


class KVFormat(ABC):
    """Encodes [N, width] vectors (one layer's K or V of N tokens, all KV heads) into byte records."""

    name: str
    has_sparse = False
    # Whether encoding the values a record decodes to gives that record back (int8 and int4: the per-token scale is
    # found again from the decoded values); Oaken chooses a token's outliers and groups again from its decoded
    # values, which need not give the same record (KVStorage.restores_exactly)
    encodes_decoded_exactly = True

    def __init__(self, width: int):
        self.width = width

    @property
    @abstractmethod
    def record_bytes(self) -> int:
        """Fixed bytes per token of K or V (payload and per-token parameters), where both sides' are alike."""

    def record_bytes_of(self, kind: str) -> int:
        """Fixed bytes per token of K (kind "k") or V: differ only for a split format (split.py)."""
        return self.record_bytes

    @property
    def expected_sparse_bytes(self) -> float:
        """Sparse bytes per token on typical data (0 for dense formats): sizes the sparse pages."""
        return 0.0

    @property
    def max_sparse_bytes(self) -> int:
        """Sparse bytes of a token at worst (every value an outlier)."""
        return 0

    @abstractmethod
    def encode(self, x: torch.Tensor, layer: int, kind: str, positions: torch.Tensor) -> EncodedTokens:
        """x float32 [N, width] at sequence positions [N]."""

    @abstractmethod
    def decode(
        self, dense: torch.Tensor, sparse: torch.Tensor | None, layer: int, kind: str, positions: torch.Tensor
    ) -> torch.Tensor:
        """float32 [M, width] from M records (and exactly their sparse bytes, in order)."""

    def store_in_place(self, kernel, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, records: dict[str, torch.Tensor], sparse: dict[str, SparsePages]) -> bool:
        """Encode one layer's new K and V (float32 [N, width], tokens at `slots` and sequence `positions`) and write
        them, records (`records[kind]`, this layer's) and sparse bytes, in one call of the compiled `kernel`. False
        where the format has no such writer (or it does not apply): the storage then encodes and writes them itself."""
        return False

    def attend_in_place(self, kernel, layer: int, q: torch.Tensor, records: dict[str, torch.Tensor],
                        sparse: dict[str, SparsePages], block_tables: torch.Tensor,
                        context_lens: torch.Tensor, block_size: int,
                        min_shared_tokens: int = 0, window: int = 0) -> torch.Tensor | None:
        """Decode attention of q [n, heads, head_dim] (float32) over each sequence's first context_lens tokens (its
        last `window` of them where that is not 0), read by the compiled `kernel` from this layer's records
        (`records[kind]` uint8 [slots, record_bytes]) and the cache's sparse pages (`sparse[kind]`) where they lie,
        a prefix of min_shared_tokens or more that the sequences share once for all (0: never); None where the
        format has no such reader."""
        return None

    def read_in_place(self, kernel, layer: int, records: dict[str, torch.Tensor], sparse: dict[str, SparsePages],
                      block_tables: torch.Tensor, context_lens: torch.Tensor,
                      block_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V float32 [n, T, width] of every token of whole-block keys (T = the tables' width in tokens; zeros from
        each sequence's context length on), decoded by the compiled `kernel`'s reader from this layer's records and
        sparse pages where they lie, as `attend_in_place` reads them; None where the format has no such reader."""
        return None

    def store_on_gpu(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, records: dict[str, torch.Tensor], sparse: dict[str, SparsePages]) -> bool:
        """`store_in_place` by the GPU kernels (kv/gpu), a launch or two per K/V and no wait for the device; here
        side by side (`store_side_on_gpu`). False where the format has none: the storage then encodes and writes
        both sides itself (over any side written here)."""
        return (self.store_side_on_gpu("k", k, slots, records["k"])
                and self.store_side_on_gpu("v", v, slots, records["v"]))

    def store_side_on_gpu(self, kind: str, x: torch.Tensor, slots: torch.Tensor, records: torch.Tensor) -> bool:
        """One side's new values x [N, width] (K's: kind "k", or V's) encoded and written at `slots` of this layer's
        `records` of that side by the GPU kernels; False where the format has no such kernel."""
        return False

    def gather_on_gpu(self, layer: int, kind: str, records: torch.Tensor, sparse: SparsePages | None,
                      slots: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Values [M, width] in `dtype` of the tokens at `slots` [M] (positions [M]; -1: padding, read as zeros) from
        this layer's `records` (uint8 [slots, record_bytes]) and sparse pages, decoded by the GPU kernels (kv/gpu) in
        one launch; None where the format has none (the storage then gathers and decodes with torch)."""
        return None
