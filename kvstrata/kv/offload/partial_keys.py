"""InfiniGen's partial keys on the compute device: per layer and KV head, the skewed partial key of every cache slot.

They are kept block by block with the channels outermost, [layers, kv_heads, blocks, r, block_size]: scoring a
block against a query is then r multiply-adds over `block_size` consecutive values (the compiled selection reads
them so, kv/kernels/infinigen_select.cpp), where a row per token would cost a dot product of r values each.

They are stored in float16, as the paper's FP16 models keep them, whatever the KV's dtype: every decode step reads
all of them, so their bytes set the speculation's time on a CPU (half of float32's), and they only rank tokens
(the attention itself runs over the fetched K/V).
"""

from __future__ import annotations

import torch


class PartialKeys:
    def __init__(self, layers: int, kv_heads: int, num_slots: int, partial: int, block_size: int,
                 device: torch.device):
        self.block_size = block_size
        self.data = torch.zeros(layers, kv_heads, num_slots // block_size, partial, block_size, dtype=torch.float16,
                                device=device)

    def places(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where `slots` [T] lie, as `write` takes them: each one's block and its column within the block (worked
        out once for every layer of a step)."""
        return slots // self.block_size, slots % self.block_size

    def write(self, layer: int, places: tuple[torch.Tensor, torch.Tensor], partial: torch.Tensor) -> None:
        """partial [kv_heads, T, r]: the partial keys of the tokens at `places` (of T slots)."""
        blocks, columns = places
        self.data[layer][:, blocks, :, columns] = partial.transpose(0, 1).half()

    def of_slots(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """float32 [kv_heads, *slots.shape, r]: the partial keys of any slots."""
        picked = self.data[layer][:, slots // self.block_size, :, slots % self.block_size]  # [*slots.shape, G, r]
        return picked.movedim(-2, 0).float()

    def of_blocks(self, layer: int, block_tables: torch.Tensor) -> torch.Tensor:
        """float32 [kv_heads, n, B * block_size, r]: the partial keys of whole blocks, the rows of `block_tables`
        [n, B]."""
        picked = self.data[layer][:, block_tables]  # [G, n, B, r, block]
        return picked.transpose(-1, -2).flatten(2, 3).float()
