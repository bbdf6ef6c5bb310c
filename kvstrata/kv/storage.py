"""Where cached K/V live and in what form: the storage half of the KV seam (DESIGN.md).

A storage stores the K/V of tokens at cache slots and gathers them back by slot, decoded to floats;
it never decides which tokens attention reads (kv/attention_policy.py does). The engine tells it
when a step begins and ends and which blocks the pool hands out for new content.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from kvstrata.kv.attention_batch import AttentionBatch, CachedKeys
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.fused_decode import FusedDecode
from kvstrata.kv.preloaded import Preloaded
from kvstrata.kv.slots import slots_of_positions


class KVStorage(ABC):
    block_size: int
    num_layers: int
    kv_shape: tuple[int, int]  # (kv_heads, head_dim)
    device: torch.device

    @abstractmethod
    def store(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Write K and V [n, kv_heads, head_dim] of tokens at cache slots [n] (sequence positions [n])."""

    @abstractmethod
    def gather(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [n, W, kv_heads, head_dim] of the tokens at `slots` [n, W] (sequence positions [n, W]).
        A padding row (position -1; its slot is any valid slot) may come back holding anything finite."""

    @abstractmethod
    def reset_blocks(self, blocks: list[int]) -> None:
        """Forget what newly allocated blocks held: a padding row read from a block's unwritten tail
        must be finite (0 weight times NaN is NaN)."""

    # whether `discard_tokens` does anything: where it does not, the engine does not work out the slots to give it
    keeps_discarded_tokens = False

    def discard_tokens(self, slots: torch.Tensor) -> None:
        """Forget the tokens at `slots` [n], the last written to their blocks (a sequence's rejected drafts), so that
        tokens written there next replace them. Storage where a slot written again holds the new token alone needs
        nothing."""

    def gather_keys(self, layer: int, keys: CachedKeys, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `keys`; storage that can copy whole blocks overrides this for keys that are whole blocks."""
        return self.gather(layer, keys.slots, keys.positions, dtype)

    def copy_stored_blocks(self, layer: int, block_tables: torch.Tensor,
                           empty: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]
                           ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V of the whole blocks of `block_tables` [n, W] copied as they are stored, nothing decoded, into
        tensors that `empty(name, shape, dtype)` hands out ("k" and "v": a caller's buffers, kept from call to
        call); seen as `gather_keys` gives them ([n, W * block_size, kv_heads, head_dim]), in the storage's dtype.
        None where the storage keeps a form it must decode (the caller then gathers the keys)."""
        return None

    def copy_stored_rows(self, layer: int, slots: torch.Tensor,
                         empty: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V of each KV head's own rows `slots` [kv_heads, R] as they are stored, nothing decoded, into tensors
        from `empty` as for `copy_stored_blocks`: [kv_heads, R, head_dim] each, in the storage's dtype. None where
        the storage keeps a form it must decode (the caller then uses `gather_per_head`)."""
        return None

    def gather_per_head(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [kv_heads, n, W, head_dim] where each KV head reads tokens of its own: `slots` and `positions`
        [kv_heads, n, W] (a speculated subset per head). This default decodes every head of each head's tokens
        and keeps its own; storage that can read one head alone overrides it."""
        per_head = [self.gather(layer, slots[h], positions[h], dtype) for h in range(self.kv_shape[0])]
        return tuple(torch.stack([kv[which][:, :, h] for h, kv in enumerate(per_head)]) for which in (0, 1))

    def attend_in_place(self, layer: int, q: torch.Tensor, keys: CachedKeys, context_lens: torch.Tensor,
                        window: int = 0) -> torch.Tensor | None:
        """Decode attention of q [n, heads, head_dim] over whole-block `keys` (each sequence's first
        context_lens tokens, or its last `window` of them: a sliding window; 0: all), read where the storage keeps
        them; None where this storage has no such path (the policy then gathers the keys and calls the reference
        attention)."""
        return None

    def fused_decode(self, batch: AttentionBatch, dtype: torch.dtype) -> FusedDecode | None:
        """For a step of decodes alone (`batch` one decode group) reading every cached key, with activations in
        `dtype`: the tensors of the one-operator-per-layer path (kv/fused_decode.py); None where this storage has
        none (the model then calls the policy layer by layer)."""
        return None

    def grown_bytes(self) -> int:
        """Bytes this storage took beyond what it was built with (pools that grow when the data need more: Oaken's
        sparse pages, KIVI's window); 0 for storage that never grows."""
        return 0

    def attach_block_pool(self, pool: BlockPool) -> None:
        """The engine's block pool, for storage that must know which blocks no sequence holds (KIVI)."""

    def begin_step(self, batch: AttentionBatch) -> None:
        """A step over `batch` starts; every layer's `store` and `gather` of the step follow."""

    def end_step(self) -> None:
        """The step's last layer is done."""

    def write(self, block_table: list[int], kv: Preloaded, first: int, end: int) -> None:
        """Store the K and V that `kv` holds for positions first .. end of a sequence, layer after layer
        (each layer is loaded only when it is written), as a step of its own."""
        table, positions, slots = self.sequence_range(block_table, first, end)
        self.begin_write(table, slots, end)
        try:
            for layer in range(self.num_layers):
                k, v = kv.layer_kv(layer, first, end)
                self.store(layer, slots, positions, k.to(self.device), v.to(self.device))
        finally:
            self.end_step()

    def sequence_range(self, block_table: list[int], first: int,
                       end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sequence's block table [1, B], and the positions first .. end and their slots [end - first]."""
        table = torch.tensor([block_table], dtype=torch.long, device=self.device)
        positions = torch.arange(first, end, device=self.device)
        return table, positions, slots_of_positions(table, positions, self.block_size)[0]

    def begin_write(self, block_table: torch.Tensor, slots: torch.Tensor, context_len: int) -> None:
        """`write` is about to store a sequence's tokens into `slots`, up to `context_len` (block_table [1, B])."""

    def restores_exactly(self, dtype: torch.dtype) -> bool:
        """Whether the K/V that `read` gives of a partly filled block, cast to the compute `dtype` and stored again,
        stores the same values, so that one sequence's tokens may be handed to another as decoded KV (beam search's)
        instead of being computed anew. Decoded values keep more bits than a narrower dtype holds, so by default
        only in float32."""
        return dtype == torch.float32

    def read_layers(self, block_table: list[int], end: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [layers, end - first, kv_heads, head_dim] of one sequence's positions first .. end in every
        layer (decoded, fp32), outside a step; storage that can read all layers at once overrides this."""
        layers = [self.read(layer, block_table, end, first) for layer in range(self.num_layers)]
        return torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers])

    def read(self, layer: int, block_table: list[int], end: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [end - first, kv_heads, head_dim] of one sequence's positions first .. end (decoded, fp32), outside
        a step (tools, tests, the KV store's copies)."""
        _, positions, slots = self.sequence_range(block_table, first, end)
        k, v = self.gather(layer, slots[None], positions[None], torch.float32)
        return k[0], v[0]
