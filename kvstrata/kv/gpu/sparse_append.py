"""Appending tokens' variable-length bytes to their blocks' sparse pages (kv/sparse_pages.py) in Triton: one launch
per layer and K/V, with no wait for the device.

Tokens of one block come in slot order and next to each other (a sequence's tokens of a step), so one program per
token starts, and the first token of each block's run writes the whole run in order: each token's offset and count,
the pages the block needs next (taken from the layer's free-page stack with an atomic decrement), then its bytes.
The caller makes sure beforehand that the stack holds the pages the call can need (SparsePages.append_on_gpu): the
kernel does not check, and an empty stack would hand page 0 out again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sparse_append(slots, entries, entry_bytes, count, pages, block_pages, block_fill, token_offset, token_count,
                   free_stack, free_count, max_token_bytes, max_pages, BLOCK_SIZE: tl.constexpr,
                   PAGE_BYTES: tl.constexpr,
                   BYTES: tl.constexpr):
    token = tl.program_id(0)
    block = tl.load(slots + token) // BLOCK_SIZE
    before = tl.load(slots + tl.maximum(token - 1, 0)) // BLOCK_SIZE
    if (token == 0) | (before != block):
        owned = block_pages + block * max_pages
        fill = tl.load(block_fill + block)
        i = token
        more = token >= 0  # true; a tensor, as the loop needs
        while more:
            slot = tl.load(slots + i)
            size = tl.load(entry_bytes + i).to(tl.int64)
            new_page = tl.cdiv(fill, PAGE_BYTES)  # the block owns its pages below this one
            while new_page < tl.cdiv(fill + size, PAGE_BYTES):  # (a loop over a range read from memory)
                top = tl.atomic_add(free_count, -1)
                tl.store(owned + new_page, tl.load(free_stack + tl.maximum(top - 1, 0)))
                new_page += 1
            tl.debug_barrier()  # the pages stored above are read below, maybe by other threads
            offsets = tl.arange(0, BYTES)
            logical = fill + offsets
            mask = offsets < size
            page = tl.load(owned + logical // PAGE_BYTES, mask=mask, other=0)
            data = tl.load(entries + i.to(tl.int64) * max_token_bytes + offsets, mask=mask, other=0)
            tl.store(pages + page * PAGE_BYTES + logical % PAGE_BYTES, data, mask=mask)
            tl.store(token_offset + slot, fill.to(tl.int32))
            tl.store(token_count + slot, size.to(tl.int16))
            fill += size
            i += 1
            more = i < count
            if more:
                more = tl.load(slots + i) // BLOCK_SIZE == block
        tl.store(block_fill + block, fill)


def sparse_append(layer_pages: list[torch.Tensor], slots: torch.Tensor, entries: torch.Tensor,
                  entry_bytes: torch.Tensor, block_size: int, page_bytes: int) -> None:
    """Append token i's first entry_bytes[i] bytes of entries[i] to the sparse pages of the block of slots[i];
    `layer_pages` is one layer's SparsePages.writer_tensors."""
    data, block_pages, block_fill, token_offset, token_count, free_stack, free_count = layer_pages
    if len(slots):
        _sparse_append[(len(slots),)](slots.contiguous(), entries, entry_bytes, len(slots), data, block_pages,
                                      block_fill, token_offset, token_count, free_stack, free_count, entries.shape[1],
                                      block_pages.shape[1], block_size, page_bytes,
                                      triton.next_power_of_2(entries.shape[1]))
